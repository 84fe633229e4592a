"""Damaged inputs, checkpoint identity, validation before compute and one way to name a run
(issue 45, items 3 to 7): each case a one-line refusal, exit 2, or the documented recovery.
"""

import json
import shutil

import pytest
import yaml
from conftest import copy_runs, tiny_config

from moelab.cli import main
from moelab.errors import UserError
from moelab.train.checkpoint import checkpoint_identity
from moelab.train.identity import run_id


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(result, *words: str) -> str:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("moelab "), err
    assert "Traceback" not in err and len(lines[-1]) < 2200
    for word in words:
        assert word in lines[-1], err
    return lines[-1]


@pytest.fixture
def root(small_runs, tmp_path, monkeypatch):
    return copy_runs(small_runs, tmp_path, monkeypatch)


# ------------------------------------------------------------------ export verify


def test_verify_refuses_a_damaged_or_foreign_export_in_one_line(root, capsys):
    assert cli(capsys, "export", "full", "--out", "hf")[0] == 0
    assert cli(capsys, "export", "other", "--out", "hf-other")[0] == 0

    def verify(export):
        return cli(capsys, "export", "verify", "full", "--export", export, "--out", "v")

    refused(verify("hf-other"), "export of run", run_id(root / "other")[:12],
            run_id(root / "full")[:12])
    for i, (name, damage, words) in enumerate([
            ("config.json", lambda p: p.write_text("{not json"), ["not a readable JSON"]),
            ("config.json", lambda p: p.write_text(json.dumps(
                {**json.loads(p.read_text()), "num_experts": 8})), ["num_experts 8"]),
            ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:1000]),
             ["truncated or damaged"]),
            ("tokenizer.json", lambda p: p.unlink(), ["lacks tokenizer.json"]),
            ("tokenizer_config.json", lambda p: p.unlink(), ["lacks tokenizer_config.json"])]):
        copy = root / f"hf-{i}"
        shutil.copytree(root / "hf", copy)
        damage(copy / name)
        refused(verify(copy), *words)


# ------------------------------------------------------------------ identity


def test_checkpoints_record_the_run_corpus_and_tokenizer(root):
    saved = checkpoint_identity(root / "full", 16)
    assert saved["run_id"] == run_id(root / "full") != run_id(root / "other")
    meta = json.loads((root / "data" / "meta.json").read_text())
    assert saved["corpus_sha256"] == meta["content_sha256"]
    assert len(saved["tokenizer_sha256"]) == 64


def test_a_checkpoint_of_another_run_is_refused_naming_both(root, capsys):
    # half's checkpoints are full's (a copy): with an id of its own, half is another run
    theirs, ours = run_id(root / "half"), "0" * 32
    (root / "half" / "run_id.json").write_text(json.dumps({"run_id": ours}))
    for argv in (["train", "half", "--config", "config.yaml"],
                 ["generate", "half", "--max-new-tokens", "1"],
                 ["eval", "bpb", "half"], ["export", "half", "--out", "hf"]):
        refused(cli(capsys, *argv), theirs, ours)
    assert not (root / "hf").exists()


def test_another_corpus_or_tokenizer_is_refused_naming_both(root, capsys):
    meta_path = root / "data" / "meta.json"
    meta = json.loads(meta_path.read_text())
    was = meta["content_sha256"]
    meta_path.write_text(json.dumps({**meta, "content_sha256": "f" * 64}))
    for argv in (["generate", "full", "--max-new-tokens", "1"], ["eval", "bpb", "full"],
                 ["export", "full", "--out", "hf"], ["train", "full", "--config", "config.yaml"]):
        refused(cli(capsys, *argv), "corpus", was[:12], "ffffffffffff")
    meta_path.write_text(json.dumps(meta))
    from moelab.data.tokenizer import train_tokenizer

    train_tokenizer(["another corpus entirely"] * 5, 300).save(str(root / "data" /
                                                                  "tokenizer.json"))
    refused(cli(capsys, "generate", "full", "--max-new-tokens", "1"), "tokenizer")


# ------------------------------------------------------------------ generate


def test_generate_refuses_a_prompt_that_is_not_utf8(root, capsys):
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # how argv carries such bytes
    refused(cli(capsys, "generate", "full", "--prompt", prompt), "not UTF-8")


def test_generate_bounds_the_prompt_pass_and_names_the_largest_prompt(root, capsys):
    line = refused(cli(capsys, "generate", "full", "--prompt", "word " * 60_000,
                       "--max-new-tokens", "2"), "prompt pass", "largest prompt")
    largest = int(line.split("largest prompt it can take is about ")[1].split()[0])
    from moelab.config import config_from_dict
    from moelab.export.generate import generation_bytes
    from moelab.train.memory import available_bytes

    cfg = config_from_dict(yaml.safe_load((root / "full" / "config.yaml").read_text()))
    assert generation_bytes(cfg, largest + 1, largest) <= available_bytes() < \
        generation_bytes(cfg, largest + 2, largest + 1)


# ------------------------------------------------------------------ naming a run


def test_one_way_to_name_a_run_and_the_old_one_still_works(root, capsys):
    code, out, err = cli(capsys, "generate", "--run-dir", "full", "--max-new-tokens", "1")
    assert code == 0 and "--run-dir is deprecated" in err and "moelab generate full" in err
    for argv in (["generate"], ["export", "verify"], ["eval", "bpb"], ["export", "--out", "x"]):
        refused(cli(capsys, *argv), "no run directory given", "RUN_DIR")
    refused(cli(capsys, "eval", "bpb", "full", "--run-dir", "other"), "two run directories")
    refused(cli(capsys, "export", "full", "verify"), "moelab export verify full")
    (root / "afile").write_text("x")  # --out given before RUN_DIR is kept, and checked
    refused(cli(capsys, "export", "--out", "afile", "full"), "--out afile is a file")
    # an existing run resumes with its own config.yaml, not the tiny preset
    code, out, err = cli(capsys, "train", "full")
    assert code == 0 and "done: step 16" in out, err


def test_longctx_reads_the_corpus_where_train_does(root, monkeypatch, tmp_path):
    import moelab.eval.longctx as longctx
    import moelab.train.checkpoint as checkpoint
    from moelab.config import config_from_dict

    home = tmp_path / "home"
    monkeypatch.setenv("MOELAB_HOME", str(home))
    cfg = config_from_dict(tiny_config("corpus"))  # relative: under $MOELAB_HOME
    seen = {}
    monkeypatch.setattr(checkpoint, "load_latest", lambda run_dir: (None, cfg, 16))
    monkeypatch.setattr(longctx, "evaluate", lambda model, path, *a: seen.setdefault("p", path)
                        and {"loss_by_position": {}})
    monkeypatch.setattr(longctx, "_log_to_lab", lambda *a: None)
    monkeypatch.setattr(longctx, "summary", lambda result: {})
    longctx.run(root / "full", 16, 1, 1, root / "lc.json")
    assert seen["p"] == home / "corpus"


# ------------------------------------------------------------------ ladder


# three points at two compute levels (two rungs of one width, one of another)
TWO_LEVELS = [{"name": n, "model": {"d_model": d}} for n, d in (("a", 16), ("b", 16), ("c", 32))]


def ladder(root, **changes) -> str:
    spec = {"base": tiny_config("./data"), "seeds": [0, 1],
            "rungs": [{"name": f"r{d}", "model": {"d_model": d}} for d in (16, 24, 32)],
            "target": {"name": "big", "model": {"d_model": 32}, "train": {"steps": 400}},
            "fit": {"law": "compute"}}
    for key, value in changes.items():
        if value is None:
            spec.pop(key)
        else:
            spec[key] = value
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return "spec.yaml"


def test_a_ladder_is_checked_completely_before_the_first_rung(root, capsys, monkeypatch):
    monkeypatch.setenv("MOELAB_LAB", str(root / "no-lab.sqlite"))
    refused(cli(capsys, "ladder", "run", ladder(root, seeds=None)), "noise_sd")
    refused(cli(capsys, "ladder", "run", ladder(root, fit={"law": "chinchilla"})),
            "chinchilla needs at least 5", "has 3")
    backtest = {"law": "backtest", "misspecification": True}
    refused(cli(capsys, "ladder", "run", ladder(root, rungs=TWO_LEVELS, fit=backtest)),
            "needs at least 3 compute levels", "has 2")
    staged = [{"mixture": {}}, {"start": 0.5, "mixture": {"nosuch": 1.0}}]
    refused(cli(capsys, "ladder", "run", ladder(root, base={**tiny_config("./data"),
                                                            "stages": staged})), "nosuch")
    refused(cli(capsys, "ladder", "run", ladder(root), "--experiment", "exp-9"),
            "no lab database")
    assert not (root / "runs").exists()  # nothing trained, no directory made


def test_run_ladder_itself_refuses_before_the_first_rung(root, monkeypatch):
    # benchmarks (bench/ladder_heldout.py) call run_ladder, not `ladder run`: a law that
    # cannot be chosen must stop them too, not after the rungs have trained (it did: h6)
    from moelab.ladder.runner import run_ladder
    from moelab.ladder.spec import load_spec

    monkeypatch.chdir(root)
    backtest = {"law": "backtest", "misspecification": True}
    spec = load_spec(root / ladder(root, rungs=TWO_LEVELS, fit=backtest))
    with pytest.raises(UserError, match="needs at least 3 compute levels"):
        run_ladder(spec)
    assert not any((spec.out / r.name).exists() for r in spec.runs())


def test_a_rerun_over_a_run_of_another_config_names_the_change(root):
    from moelab.ladder.results import check_run_dir
    from moelab.ladder.spec import load_spec

    spec = load_spec(root / ladder(root))
    rung = spec.rungs[0]
    other = tiny_config("./data", model={"d_model": 48})
    other["stages"] = [{"mixture": {}}, {"start": 0.5, "mixture": {"code": 1.0}}]
    (root / "r").mkdir()
    (root / "r" / "config.yaml").write_text(yaml.safe_dump(other))
    with pytest.raises(UserError, match="model.d_model.*stages|stages.*model.d_model"):
        check_run_dir(rung, root / "r")
