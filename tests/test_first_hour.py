"""The first hour of a new user: stopping the first `moelab train` while it prepares the
default corpus, and carrying a finished run into the lab and its published site."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import COMPILE_CACHE

SHORT = ["--set", "train.steps=4", "--set", "train.log_every=2"]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, **COMPILE_CACHE, "MOELAB_HOME": str(tmp_path / "home"),
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
    first = proc.stdout.readline()
    assert first.startswith("preparing the default corpus at"), first
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
    assert "interrupted while preparing the corpus" in output
    assert "saving a checkpoint" not in output  # no step to finish
    assert not (corpus / "meta.json").exists()
    assert not (tmp_path / "run").exists()  # nothing of the run was created yet

    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    meta = json.loads((corpus / "meta.json").read_text())
    assert f"content sha256 {meta['content_sha256']}" in rerun.stdout
    assert "done: step 4" in rerun.stdout
