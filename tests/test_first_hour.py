"""The first hour of a new user: stopping the first `moelab train` while it prepares the
default corpus, and carrying a finished run into the lab and its published site."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SHORT = ["--set", "train.steps=4", "--set", "train.log_every=2"]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "MOELAB_HOME": str(tmp_path / "home"),
            "MOELAB_LAB": str(tmp_path / "lab.sqlite"), "PYTHONUNBUFFERED": "1"}


def _moelab(*args: str) -> list[str]:
    return [sys.executable, "-m", "moelab.cli", *args]


def test_ctrl_c_while_preparing_the_corpus_exits_at_once_and_resumes(tmp_path):
    """Ctrl-C reaches the whole process group (driver and pool workers), as a terminal
    sends it: exit 130 within 10 s, one line, no traceback, and a rerun completes."""
    env, corpus = _env(tmp_path), tmp_path / "home" / "runs" / "data" / "default"
    command = _moelab("train", *SHORT, "--run-dir", str(tmp_path / "run"))
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = [proc.stdout.readline()]
    while not seen[-1].startswith("preparing the default corpus at") and seen[-1]:
        seen.append(proc.stdout.readline())  # past any warning printed at import
    assert seen[-1], "".join(seen)
    deadline = time.time() + 120
    while not list((corpus / ".stages").glob("ingest*/*")) and time.time() < deadline:
        time.sleep(0.2)  # stop it mid-way: some stage outputs exist, the rest do not
    assert not (corpus / "meta.json").exists(), "preparation ended before the stop"
    os.killpg(proc.pid, signal.SIGINT)
    stopped = time.time()
    output = proc.communicate(timeout=10)[0]
    assert time.time() - stopped < 10
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "leaked" not in output, output
    assert output.count("interrupted") == 1 and "interrupted while preparing the corpus" in output
    assert "saving a checkpoint" not in output  # no step to finish
    assert not (corpus / "meta.json").exists()
    assert not (tmp_path / "run").exists()  # nothing of the run was created yet

    # bytes: text mode would turn the progress bars' "\r" into line ends
    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=600)
    stdout, stderr = rerun.stdout.decode(), rerun.stderr.decode()
    assert rerun.returncode == 0, stderr[-2000:]
    meta = json.loads((corpus / "meta.json").read_text())
    assert f"content sha256 {meta['content_sha256']}" in stdout
    assert "done: step 4" in stdout
    assert "\n\n" not in stdout and "\n\n" not in stderr  # no blank lines (tokenizer)


def test_a_finished_run_attached_later_shows_its_metrics_in_the_store_and_site(
        write_config, tmp_path, monkeypatch, capsys):
    """Train without --experiment, then `lab attach`: the run's metrics and events are in
    the store and on the published site, as if it had been attached from the start."""
    from moelab import cli
    from moelab.lab.store import Store

    lab, run_dir = tmp_path / "lab.sqlite", tmp_path / "run"
    monkeypatch.setenv("MOELAB_LAB", str(lab))
    monkeypatch.chdir(tmp_path)
    config = write_config(train={"steps": 8, "log_every": 4, "eval_every": 4,
                                 "checkpoint_every": 4})
    assert cli.main(["train", "--config", str(config), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"moelab lab attach {run_dir} --experiment ID" in out  # the next commands
    assert f"moelab export {run_dir} --out" in out  # the positional RUN_DIR (issue 45)
    assert re.search(r"step 8/8 loss=\S+ .* eta=0s val code=\d\.\d+ prose=\d\.\d+", out), out
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # as the printed next commands say: the experiment takes the run's own config
    assert f"--config {run_dir / 'config.yaml'}" in out
    assert cli.main(["lab", "new", "first", "--hypothesis", "it learns", "--config",
                     str(run_dir / "config.yaml")]) == 0
    exp_id = capsys.readouterr().out.strip()
    assert cli.main(["lab", "attach", str(run_dir), "--experiment", exp_id]) == 0
    assert "8 steps imported, finished at step 8" in capsys.readouterr().out
    with Store(lab, mode="ro") as store:
        (run,) = store.runs(exp_id)
        assert run.status == "succeeded" and run.run_dir == str(run_dir)
        assert store.metrics(run.id, "loss") == [(r["step"], r["loss"]) for r in logged]
        assert store.latest(run.id)["val_loss/code"][0] == 8
    assert cli.main(["lab", "attach", str(run_dir), "--experiment", exp_id]) == 2  # once
    assert "already attached" in capsys.readouterr().err

    assert cli.main(["lab", "publish", str(tmp_path / "site")]) == 0
    assert "wrote 4 pages" in capsys.readouterr().out  # index, findings, experiment, compare
    page = (tmp_path / "site" / "experiments" / f"{exp_id}.html").read_text()
    assert f"<td>{run.id}</td><td>succeeded</td><td>8</td><td>{logged[-1]['loss']:.4g}" in page

    # the same through `moelab train --experiment` on a finished run (a copy, not attached)
    other_dir = tmp_path / "other"
    shutil.copytree(run_dir, other_dir)
    (other_dir / "lab_run.json").unlink()
    assert cli.main(["lab", "new", "again", "--hypothesis", "h", "--config", str(config)]) == 0
    second = capsys.readouterr().out.strip()
    for _ in range(2):  # and a second time: the run has ended already, nothing to record
        assert cli.main(["train", "--config", str(config), "--run-dir", str(other_dir),
                         "--experiment", second]) == 0
    with Store(lab, mode="ro") as store:
        (run2,) = store.runs(second)
        assert run2.status == "succeeded"
        assert store.metrics(run2.id, "loss") == [(r["step"], r["loss"]) for r in logged]


def test_a_refused_report_leaves_no_empty_static_folder(tmp_path, monkeypatch, capsys):
    """Without plotly (the lab extra) `lab report` refuses in one line and writes nothing."""
    from moelab import cli

    monkeypatch.setitem(sys.modules, "plotly", None)  # as if the lab extra were missing
    lab = str(tmp_path / "lab.sqlite")
    assert cli.main(["lab", "--lab", lab, "new", "q", "--hypothesis", "h", "--config",
                     "tiny"]) == 0
    out = tmp_path / "report"
    assert cli.main(["lab", "--lab", lab, "report", "exp-1", "--out", str(out)]) == 2
    assert "pip install -e '.[lab]'" in capsys.readouterr().err
    assert not out.exists()


def test_misspelled_names_get_the_presets_and_the_nearest_name(capsys):
    from moelab import cli

    for argv, hint in [(["train", "--config", "Tiny"], "did you mean 'tiny'?"),
                       (["train", "--config", "small.yaml"], "did you mean 'small'?"),
                       (["lab", "new", "x", "--hypothesis", "h", "--config", "Small"],
                        "did you mean 'small'?"),
                       (["ladder", "plan", "defualt"], "did you mean 'default'?"),
                       (["train", "--set", "trian.steps=5"],
                        "unknown section(s) ['trian'] (did you mean 'train'?)"),
                       (["train", "--set", "train.stpes=5"],
                        "train: unknown key(s) ['stpes'] (did you mean 'steps'?)")]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert hint in err and len(err.strip().splitlines()) == 1, err
        assert "error: :" not in err
    assert "presets: tiny, small" in (cli.main(["train", "--config", "nope.yaml"]),
                                      capsys.readouterr().err)[1]
    assert cli.main(["ladder", "plan", "default"]) == 0  # the README's preset, by name
    assert capsys.readouterr().out.startswith("ladder default -> runs/ladder/default")


def test_every_option_of_every_command_has_help_with_its_default():
    import argparse

    from moelab import cli

    def options(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    yield from options(subparser, f"{name} {sub}")
            elif action.dest != "help":
                yield name, action, parser

    for name, action, _ in options(cli.build_parser(), "moelab"):
        assert action.help, f"{name} {action.dest} has no help"
    generate = next(p for n, _, p in options(cli.build_parser(), "moelab")
                    if n == "moelab generate")
    text = " ".join(generate.format_help().split())
    for default in ("(default: 64)", "(default: 0.8)", "(default: 0.95)", "(default: 0)"):
        assert default in text


def test_a_refused_start_leaves_nothing_behind(write_config, tmp_path, monkeypatch, capsys):
    """Refusals come before the run dir, its lock and its checkpoints exist: a run dir of
    another config stays as it was, and a fresh one is not created."""
    from moelab import cli
    from moelab.config import load_config
    from moelab.train.rundir import save_config

    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "lab.sqlite"))
    config, other = write_config(), write_config(train={"steps": 13})
    existing = tmp_path / "existing"
    existing.mkdir()
    save_config(existing, load_config(other), 0, False)
    before = sorted(p.name for p in existing.iterdir())
    assert cli.main(["train", "--config", str(config), "--run-dir", str(existing)]) == 2
    assert "train.steps: run 13, now 12" in capsys.readouterr().err
    assert sorted(p.name for p in existing.iterdir()) == before  # no lock, no checkpoints

    assert cli.main(["lab", "new", "q", "--hypothesis", "h", "--config", str(other)]) == 0
    capsys.readouterr()
    fresh = tmp_path / "fresh"
    assert cli.main(["train", "--config", str(config), "--run-dir", str(fresh),
                     "--experiment", "exp-1"]) == 2
    assert "differs from experiment exp-1's snapshot" in capsys.readouterr().err
    assert not fresh.exists()
    # checks that need the corpus (vocabulary) or the run dir's lock (memory) first
    small = write_config(model={"vocab_size": 300})
    assert cli.main(["train", "--config", str(small), "--run-dir", str(fresh)]) == 2
    assert "model.vocab_size" in capsys.readouterr().err
    assert not fresh.exists()
    huge = write_config(moe={"n_experts": 3_000_000})  # ~300 GB of params and AdamW state
    assert cli.main(["train", "--config", str(huge), "--run-dir", str(fresh)]) == 2
    assert "GiB per device" in capsys.readouterr().err
    assert not fresh.exists()


def test_the_corpus_content_hash_covers_every_input_file(small_corpus):
    from moelab.data.loader import read_meta
    from moelab.data.provenance import content_sha256, read_manifest

    records = list(read_manifest(small_corpus))
    assert read_meta(small_corpus)["content_sha256"] == content_sha256(records)
    changed = [dict(r) for r in records]
    changed[3]["sha256"] = "0" * 64  # one input file edited (a package upgraded, say)
    assert content_sha256(changed) != content_sha256(records)


def test_a_relative_data_path_lives_under_moelab_home(small_corpus, tmp_path, monkeypatch):
    """One place for data: not the working directory, unless the path says ./ ."""
    from moelab.config import ConfigError, data_dir, load_config
    from moelab.train.trainer import prepared_data

    monkeypatch.setenv("MOELAB_HOME", str(tmp_path / "home"))
    assert data_dir("runs/data/default") == tmp_path / "home" / "runs" / "data" / "default"
    assert data_dir("./mine") == Path("mine") and data_dir(str(tmp_path)) == tmp_path
    monkeypatch.chdir(small_corpus.parent)
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{path: {small_corpus.name}}}\nmodel: {{vocab_size: 512}}\n")
    with pytest.raises(ConfigError, match=f"write data.path: ./{small_corpus.name}"):
        prepared_data(load_config(config))
    config.write_text(f"data: {{path: ./{small_corpus.name}}}\nmodel: {{vocab_size: 512}}\n")
    assert prepared_data(load_config(config)) == Path(small_corpus.name)
