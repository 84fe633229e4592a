"""`moelab lab ...` end to end through the real entry point (with only the lab part loaded,
so other parts' work in progress cannot break these tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab import cli
from moelab.lab.store import Store


@pytest.fixture
def moelab(monkeypatch, capsys, tmp_path):
    """Run `moelab lab --lab <tmp> ARGS...`; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(cli, "PARTS", ["moelab.lab.cli"])
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["lab", "--lab", str(tmp_path / "lab.sqlite"), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("train:\n  steps: 20\nmoe:\n  n_experts: 4\n")
    return path


def test_new_list_show_finish_report(moelab, config, tmp_path):
    code, out, _ = moelab("new", "qk-norm", "--hypothesis", "no spikes", "--config", str(config))
    exp_id = out.strip()
    assert (code, exp_id) == (0, "exp-1")
    with Store(tmp_path / "lab.sqlite") as store:
        experiment = store.get_experiment(exp_id)
        assert experiment.config == {"train": {"steps": 20}, "moe": {"n_experts": 4}}
        assert experiment.status == "planned"
        run_id = store.start_run(exp_id, "runs/q", {})
        store.log_metrics(run_id, 0, {"loss": 5.0})
        store.log_metrics(run_id, 1, {"loss": 4.0})
        store.finish_run(run_id, "failed", "OOM at step 2")
    assert moelab("list")[1].split() == ["exp-1", "running", "1", "runs", "qk-norm"]
    assert "| run-1 | failed | 1 | 4 | runs/q | OOM at step 2 |" in moelab("show", exp_id)[1]
    assert moelab("finish", exp_id, "--status", "failed", "--outcome", "OOM")[0] == 0
    code, out, _ = moelab("report", exp_id)
    assert code == 0
    assert {Path(line).name for line in out.split()} == {"report.html", "summary.md", "loss.png"}
    assert (tmp_path / "runs/reports/exp-1/report.html").is_file()


def test_read_commands_on_missing_lab_exit_2_with_the_fix(moelab):
    for argv in (["list"], ["show", "exp-1"], ["report", "exp-1"], ["serve", "--port", "0"]):
        code, _, err = moelab(*argv)
        assert code == 2
        assert "no lab database at" in err and "moelab lab new" in err


def test_bad_input_is_one_line_and_exit_2(moelab, config, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe:\n  top_k: 9\n")
    code, _, err = moelab("new", "x", "--hypothesis", "h", "--config", str(bad))
    assert code == 2 and "moe.top_k" in err and len(err.strip().splitlines()) == 1
    moelab("new", "x", "--hypothesis", "h", "--config", str(config))
    code, _, err = moelab("finish", "exp-1", "--status", "succeeded", "--outcome", "fine")
    assert code == 2 and "is planned and cannot become succeeded" in err
    (tmp_path / "lab.sqlite").write_bytes(b"garbage" * 1000)
    code, _, err = moelab("list")
    assert code == 2 and "not a readable moelab lab database" in err


def test_lab_option_after_the_subcommand_and_presets(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "PARTS", ["moelab.lab.cli"])
    monkeypatch.chdir(tmp_path)
    lab = str(tmp_path / "other.sqlite")
    assert cli.main(["lab", "new", "x", "--hypothesis", "h", "--config", "tiny",
                     "--lab", lab]) == 0
    assert capsys.readouterr().out.strip() == "exp-1"
    with Store(lab) as store:  # the preset's YAML is the snapshot
        assert store.get_experiment("exp-1").config["model"]["d_model"] > 0
    assert cli.main(["lab", "--lab", lab, "list"]) == 0  # before the subcommand too
    assert "exp-1" in capsys.readouterr().out
    assert cli.main(["lab", "list", "--lab", str(tmp_path / "missing.sqlite")]) == 2
    assert "no lab database at" in capsys.readouterr().err


def test_every_lab_option_has_help_and_shows_its_default(monkeypatch):
    import argparse

    monkeypatch.setattr(cli, "PARTS", ["moelab.lab.cli"])
    lab = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction)).choices["lab"]
    commands = next(a for a in lab._actions if isinstance(a, argparse._SubParsersAction))
    assert {"new", "list", "show", "finish", "report", "publish", "serve"} <= set(
        commands.choices)
    for name, parser in commands.choices.items():
        for action in parser._actions:
            assert action.help, f"lab {name} {action.dest} has no help"
    serve_help = commands.choices["serve"].format_help()
    assert "(default: 8765)" in serve_help and "(default: 127.0.0.1)" in serve_help


def test_version(capsys):
    import moelab

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moelab {moelab.__version__}"


def test_publish_writes_a_site(moelab, config, tmp_path):
    moelab("new", "q", "--hypothesis", "h", "--config", str(config))
    code, out, _ = moelab("publish", str(tmp_path / "site"))
    assert code == 0 and "wrote 3 pages" in out  # index, findings, one experiment
    assert (tmp_path / "site/static/plotly.min.js").is_file()
    (tmp_path / "file").write_text("")
    code, _, err = moelab("publish", str(tmp_path / "file"))
    assert code == 2 and "is a file" in err


def test_serve_refuses_bad_and_busy_ports_in_one_line(moelab, config, tmp_path):
    import socket

    moelab("new", "q", "--hypothesis", "h", "--config", str(config))
    code, _, err = moelab("serve", "--port", "99999")
    assert code == 2 and "0..65535" in err and len(err.strip().splitlines()) == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, _, err = moelab("serve", "--port", str(busy.getsockname()[1]))
    assert code == 2 and "cannot listen on" in err and len(err.strip().splitlines()) == 1


def test_help_of_every_part_shows_each_default():
    """`moelab X --help` for every part and subcommand: an option with help text and a
    default shows the default (argparse cannot show it for an option with no help text;
    test_every_lab_option_has_help_and_shows_its_default holds the lab to having it)."""
    import argparse

    def parsers(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    checked = 0
    for parser in parsers(cli.build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if (action.option_strings and action.help and action.help != argparse.SUPPRESS
                    and default is not None and default is not False and default != []
                    and default != argparse.SUPPRESS and not action.required):
                assert str(default) in text, f"{parser.prog} {action.option_strings}"
                checked += 1
    assert checked >= 5  # lab serve alone has --host and --port


def test_report_and_publish_never_overwrite_a_users_files(moelab, config, tmp_path):
    moelab("new", "q", "--hypothesis", "h", "--config", str(config))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "summary.md").write_text("my notes")
    (theirs / "index.html").write_text("my page")
    for argv in (["report", "exp-1", "--out", str(theirs)], ["publish", str(theirs)]):
        code, out, err = moelab(*argv)
        assert code == 2 and "not empty and moelab did not make it" in err and not out
    assert sorted(p.name for p in theirs.iterdir()) == ["index.html", "summary.md"]
    assert (theirs / "summary.md").read_text() == "my notes"
    for argv in (["report", "exp-1", "--out", "rep"], ["publish", "site"]):
        assert moelab(*argv)[0] == 0
        assert moelab(*argv)[0] == 0  # an earlier report or site of moelab's is rewritten
    legacy = tmp_path / "old-report"  # written before reports were marked
    legacy.mkdir()
    for name in ("report.html", "summary.md"):
        (legacy / name).write_text("old")
    assert moelab("report", "exp-1", "--out", str(legacy))[0] == 0
    assert (legacy / "summary.md").read_text() != "old"
