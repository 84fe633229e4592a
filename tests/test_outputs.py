"""No command deletes or overwrites what moelab did not create, and every writer refuses a
bad output path in one line before it computes anything (issue 45, items 1 and 2).

Tests run as root, where a directory's mode bits do not stop writes; "not writable" is
simulated by monkeypatching `moelab.outputs.writable` (the one os.access check every writer
goes through), and "under a file" by a path below a regular file, which no user can write.
"""

import json

import pytest
import yaml
from conftest import copy_runs, tiny_config

from moelab import outputs
from moelab.cli import main
from moelab.lab.store import Store


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moelab "), err
    for word in words:
        assert word in lines[0], err


@pytest.fixture
def root(small_runs, tmp_path, monkeypatch):
    return copy_runs(small_runs, tmp_path, monkeypatch)


def user_dir(path):
    """A directory with a user's file in it: what no command may delete."""
    path.mkdir(parents=True)
    (path / "mine.txt").write_text("keep me")
    return path


def bad_paths(root):
    """(path, words the refusal names) for each kind of output path a writer must refuse."""
    afile = root / "afile"
    afile.write_text("x")
    return [(afile, "is a file"), (afile / "sub", "which is a file"),
            (user_dir(root / "theirs"), "not empty")]


def untouched(root):
    assert (root / "afile").read_text() == "x"
    assert [p.name for p in (root / "theirs").iterdir()] == ["mine.txt"]


def test_export_refuses_bad_outputs_and_force_replaces_only_its_own(root, capsys):
    for path, words in bad_paths(root):
        one_line_error(*cli(capsys, "export", "full", "--out", path)[::2], words)
    one_line_error(*cli(capsys, "export", "full", "--out", root / "theirs", "--force")[::2],
                   "did not make it")
    untouched(root)
    assert cli(capsys, "export", "full", "--out", root / "hf")[0] == 0
    assert outputs.is_ours(root / "hf")
    one_line_error(*cli(capsys, "export", "full", "--out", root / "hf")[::2], "--force")
    (root / "hf" / "NOTES.md").write_text("a user's notes beside the export")
    one_line_error(*cli(capsys, "export", "full", "--out", root / "hf", "--force")[::2],
                   "NOTES.md")  # --force replaces an export, never what a user added to it
    assert (root / "hf" / "NOTES.md").read_text() == "a user's notes beside the export"
    (root / "hf" / "NOTES.md").unlink()
    (root / "hf" / "config.json").write_text("{}")  # an export's own file, changed
    assert cli(capsys, "export", "full", "--out", root / "hf", "--force")[0] == 0
    assert json.loads((root / "hf" / "config.json").read_text())  # replaced whole
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temp


def test_unwritable_output_is_refused_before_anything_is_written(root, capsys, monkeypatch):
    monkeypatch.setattr(outputs, "writable", lambda path: False)
    one_line_error(*cli(capsys, "export", "full", "--out", root / "new" / "hf")[::2],
                   "not writable")
    one_line_error(*cli(capsys, "eval", "bpb", "full", "--out", root / "ev")[::2],
                   "not writable")
    assert not (root / "new").exists() and not (root / "ev").exists()


def test_export_verify_never_deletes_a_users_hf_directory(root, capsys):
    out = root / "exports"
    user_dir(out / "hf")
    (out / "hf" / "config.json").write_text("{}")
    code, _, err = cli(capsys, "export", "verify", "full", "--out", out)
    one_line_error(code, err)
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["config.json", "mine.txt"]
    for path, words in bad_paths(root):
        one_line_error(*cli(capsys, "export", "verify", "full", "--out", path)[::2], words)
    untouched(root)


def test_eval_outputs_are_checked_before_loading(root, capsys):
    for path, words in bad_paths(root):
        one_line_error(*cli(capsys, "eval", "bpb", "full", "--out", path)[::2], words)
        one_line_error(*cli(capsys, "eval", "tasks", "full", "--out", path)[::2], words)
    one_line_error(*cli(capsys, "eval", "longctx", "full", "--out", root / "theirs")[::2],
                   "is a directory")
    one_line_error(*cli(capsys, "eval", "longctx", "full", "--out",
                        root / "afile" / "x.json")[::2], "which is a file")
    untouched(root)


def test_ladder_run_refuses_bad_outputs_before_the_first_rung(root, capsys):
    spec = {"base": tiny_config("./data"), "seeds": [0, 1],
            "rungs": [{"name": f"r{d}", "model": {"d_model": d}} for d in (16, 24, 32)],
            "target": {"name": "big", "model": {"d_model": 32}, "train": {"steps": 400}},
            "fit": {"law": "compute"}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    for path, words in bad_paths(root):
        one_line_error(*cli(capsys, "ladder", "run", "spec.yaml", "--out", path)[::2], words)
    untouched(root)


def test_attach_to_an_unwritable_run_leaves_no_lab_run_and_a_retry_makes_one(
        root, capsys, monkeypatch):
    lab = root / "lab.sqlite"
    code, out, _ = cli(capsys, "lab", "--lab", lab, "new", "x", "--hypothesis", "h",
                       "--config", "config.yaml")
    exp = out.split()[0] if code == 0 else pytest.fail(out)
    with monkeypatch.context() as m:
        m.setattr(outputs, "writable", lambda path: False)
        one_line_error(*cli(capsys, "lab", "--lab", lab, "attach", "full",
                            "--experiment", exp)[::2], "not writable")
    # the run dir refusing the record inside the store's transaction: rolled back
    from pathlib import Path

    with monkeypatch.context() as m:
        real = Path.write_text

        def refuse(self, *args, **kwargs):
            if self.name == "lab_run.json":
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *args, **kwargs)

        m.setattr(Path, "write_text", refuse)
        code, _, err = cli(capsys, "lab", "--lab", lab, "attach", "full", "--experiment", exp)
        one_line_error(code, err, "Permission denied")
    with Store(lab) as store:
        assert store.runs(exp) == []
    assert cli(capsys, "lab", "--lab", lab, "attach", "full", "--experiment", exp)[0] == 0
    one_line_error(*cli(capsys, "lab", "--lab", lab, "attach", "full", "--experiment",
                        exp)[::2], "already attached")
    with Store(lab) as store:
        assert len(store.runs(exp)) == 1
    assert json.loads((root / "full" / "lab_run.json").read_text())["experiment"] == exp


def test_export_force_replaces_an_earlier_export_never_another_commands_output(tmp_path):
    from moelab.errors import UserError
    from moelab.export.hf import check_out

    results = tmp_path / "eval"  # what `moelab eval` wrote: marked, but not an export
    outputs.mark(results, "eval")
    (results / "bpb-step20.json").write_text("{}")
    for force in (False, True):
        with pytest.raises(UserError, match="holds what moelab eval wrote, not an earlier"):
            check_out(results, force)
    assert sorted(p.name for p in results.iterdir()) == [outputs.MARKER, "bpb-step20.json"]
    export = tmp_path / "hf"
    outputs.mark(export, "export", files={})
    with pytest.raises(UserError, match="pass --force"):
        check_out(export, False)
    assert check_out(export, True) is True


def test_sft_set_never_overwrites_a_users_files(tmp_path, capsys, monkeypatch):
    from moelab.data import sftset

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train.jsonl").write_text("mine\n")
    one_line_error(*cli(capsys, "data", "sft-set", "--out", theirs)[::2], "not empty")
    assert [p.name for p in theirs.iterdir()] == ["train.jsonl"]
    assert (theirs / "train.jsonl").read_text() == "mine\n"
    monkeypatch.setattr(sftset, "man_pairs", lambda: [("What is ls?", "It lists.", "man:ls")])
    monkeypatch.setattr(sftset, "docstring_pairs", lambda: [])
    for _ in range(2):  # a set of its own is rewritten
        assert cli(capsys, "data", "sft-set", "--out", tmp_path / "sft")[0] == 0


def test_longctx_out_never_overwrites_a_file_it_did_not_write(tmp_path):
    from moelab.errors import UserError
    from moelab.eval import longctx

    run = tmp_path / "run"  # refused before the run is read: it need not exist
    config = tmp_path / "config.yaml"
    config.write_text("model: {}\n")
    earlier = tmp_path / "longctx.json"
    earlier.write_text(json.dumps({"run_dir": "r", "step": 1, "original_length": 8}))
    for theirs in (config, tmp_path / "notes.json"):
        theirs.write_text(theirs.read_text() if theirs.exists() else '{"a": 1}')
        with pytest.raises(UserError, match="is not an earlier output of this command"):
            longctx.run(run, out=theirs)
    assert config.read_text() == "model: {}\n"
    with pytest.raises(UserError, match="no checkpoint"):  # accepted: then the run is read
        longctx.run(run, out=earlier)


def test_another_commands_output_is_not_an_output_directory(root, capsys):
    """A directory moelab marked is rewritten only by the command that made it: an
    export given as another command's --out is refused in one line naming who made it,
    before anything is loaded, and left as it was; an earlier eval's directory takes the
    next eval."""
    export = root / "exported"
    outputs.mark(export, "export", files={})
    (export / "config.json").write_text("{}")
    spec = {"base": tiny_config("./data"), "seeds": [0, 1],
            "rungs": [{"name": f"r{d}", "model": {"d_model": d}} for d in (16, 24, 32)],
            "target": {"name": "big", "model": {"d_model": 32}, "train": {"steps": 400}},
            "fit": {"law": "compute"}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    for argv in (["eval", "bpb", "full", "--out", export],
                 ["eval", "tasks", "full", "--out", export],
                 ["export", "verify", "--run-dir", "full", "--out", export],
                 ["ladder", "run", "spec.yaml", "--out", export],
                 ["lab", "report", "1", "--out", export],
                 ["lab", "publish", export],
                 ["upcycle", "full", "--experts", "4", "--top-k", "2", "--out", export]):
        one_line_error(*cli(capsys, *argv)[::2], "moelab export", str(export))
    assert sorted(p.name for p in export.iterdir()) == [outputs.MARKER, "config.json"]
    earlier = root / "results"
    outputs.mark(earlier, "eval")
    (earlier / "bpb-step1.json").write_text("{}")
    assert outputs.check_dir(earlier, made_by=("eval",)) is True
