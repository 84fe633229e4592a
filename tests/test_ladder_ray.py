"""`moelab ladder run --ray`: a real local Ray cluster (a head and two worker nodes, each
started by `ray start` as its own processes), the same numbers as the sequential ladder,
and a worker node SIGKILLed mid-run that costs only the steps since its last checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config

from moelab import cli
from moelab.jobs import attempts
from moelab.jobs.local_cluster import DRIVER_ENV, LocalCluster, free_port
from moelab.ladder.runner import run_ladder
from moelab.ladder.spec import spec_from_dict

pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def ray_spec(data_path: Path) -> dict:
    """Three rungs and a cooldown branch, one layer each (compiling is most of a tiny run's
    time), and a target long enough to be killed mid-run: 64 x 32 tokens a step, 800
    steps, a checkpoint every 100."""
    base = tiny_config(data_path, model={"n_layers": 1}, optim={"lr": 1e-2, "warmup_steps": 5},
                       train={"log_every": 1000, "eval_batches": 1, "checkpoint_every": 100,
                              "keep_checkpoints": 2})
    rung = lambda name, d, steps: {"name": name, "model": {"d_model": d, "d_ff": d},
                                   "train": {"steps": steps}}
    target = rung("big", 32, 800)
    target["data"] = {"batch_size": 64}
    return {"base": base, "seeds": [0], "evals": 2,
            "rungs": [rung("r1", 16, 40), rung("r2", 24, 40),
                      {**rung("r3", 32, 60), "branches": [50]}],
            "target": target, "fit": {"bootstrap": 10, "law": "compute", "noise_sd": 0.01,
                   "accept_repetition": True}}  # ~3.4 passes over the tiny corpus


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def sequential(tmp_path_factory, small_corpus):
    """The same ladder trained in this process, in order: the reference numbers."""
    out = tmp_path_factory.mktemp("sequential") / "ladder"
    spec = spec_from_dict(ray_spec(small_corpus), "seq", out)
    report = run_ladder(spec)
    return spec, report


def _finals(spec) -> dict[str, list]:
    from moelab.ladder.results import result, run_dir

    return {r.name: result(r, run_dir(spec, r)).curve for r in spec.runs()}


def _run_cli(tmp_path: Path, spec_path: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moelab.cli", "ladder", "run", str(spec_path), "--ray", address,
         "--stall-timeout", "300"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **DRIVER_ENV, "MOELAB_LAB": str(tmp_path / "lab.sqlite")})


def _steps(run: Path) -> list[int]:
    """Steps of the complete lines: the trainer may be writing the last one right now."""
    *lines, _partial = (run / "metrics.jsonl").read_text().split("\n")
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.slow  # ~3 min idle: two ladders, one of them on 2 nodes of 1 CPU
def test_ladder_on_a_ray_cluster_survives_a_killed_node(cluster, sequential, tmp_path,
                                                       small_corpus):
    seq_spec, seq_report = sequential
    raw = ray_spec(small_corpus)
    spec_path = tmp_path / "ray.yaml"
    spec_path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs" / "ladder" / "ray"
    proc = _run_cli(tmp_path, spec_path, cluster.address)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    # wait until the long rung has saved a checkpoint and trained past it, then kill its node
    victim_run, deadline, killed = out / "big", time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        tries = attempts(victim_run)
        ckpts = victim_run / "checkpoints"
        if tries and ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()) and \
                (victim_run / "metrics.jsonl").exists() and max(_steps(victim_run),
                                                                default=0) >= 250:
            killed = cluster.kill_node_of(tries[-1]["pid"])
            lost_at = max(_steps(victim_run))
            break
        time.sleep(0.05)
    assert killed, "".join(output)
    assert proc.wait(timeout=600) == 0, "".join(output)
    reader.join(timeout=10)
    text = "".join(output)

    # every run finished exactly once: each step logged once, in order, to the last step
    spec = spec_from_dict(raw, "ray", out)
    for rung in spec.runs():
        steps = _steps(out / rung.name)
        first = rung.branch_step + 1 if rung.parent else 1
        assert steps == list(range(first, rung.config.train.steps + 1)), rung.name
    # the killed run was retried on the other node and resumed from its newest checkpoint:
    # it lost at most the steps since that checkpoint (checkpoint_every = 100). A kill
    # while step 100k's checkpoint is being written leaves 100(k-1) the newest complete
    # one, so exactly 100 steps are lost: the bound is <= 100, not < 100
    tries = attempts(victim_run)
    assert len(tries) == 2 and tries[1]["node"] != tries[0]["node"]
    assert tries[1]["resumes_at"] > 0 and tries[1]["resumes_at"] % 100 == 0
    assert 0 <= tries[1]["lost_steps"] <= 100 and tries[1]["resumes_at"] + tries[1]["lost_steps"] \
        >= lost_at - 1  # the metrics of the one step in flight may not have been written
    assert "retried 1x" in text and f"lost {tries[1]['lost_steps']} steps" in text
    # the same numbers as the sequential ladder: every run's whole curve, and the report
    assert _finals(spec) == _finals(seq_spec)
    report = json.loads((out / "report.json").read_text())
    assert report["predicted"] == seq_report["predicted"]
    assert report["actual"] == seq_report["actual"]


@pytest.mark.slow
def test_a_bad_rung_fails_the_ladder_before_anything_trains(cluster, tmp_path, small_corpus):
    """A rung on a dataset that is not there: the ladder's preflight (ladder/preflight.py)
    refuses it in one line before any run starts on the cluster, so nothing is retried."""
    raw = ray_spec(small_corpus)
    raw["rungs"] = [raw["rungs"][0], {**raw["rungs"][1], "data": {"path": str(tmp_path / "x")}},
                    {"name": "r3", "model": {"d_model": 32, "d_ff": 32}, "train": {"steps": 60}}]
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(yaml.safe_dump(raw))
    proc = _run_cli(tmp_path, spec_path, cluster.address)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, text  # the run's own error, as one line (a UserError)
    assert "Traceback" not in text and "is not a prepared dataset" in text
    assert not (tmp_path / "runs" / "ladder" / "bad").exists() or not attempts(
        tmp_path / "runs" / "ladder" / "bad" / "r2-s0")  # nothing ran, nothing retried


def test_bad_addresses_and_impossible_requests_fail_fast(cluster, tmp_path, small_corpus,
                                                         capsys, monkeypatch):
    raw = ray_spec(small_corpus)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    for name, value in DRIVER_ENV.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    code = cli.main(["ladder", "run", str(spec_path), "--ray", f"127.0.0.1:{free_port()}"])
    assert code == 2 and "cannot reach the Ray head" in capsys.readouterr().err
    assert time.monotonic() - started < 30
    code = cli.main(["ladder", "run", str(spec_path), "--ray", "no-port"])
    assert code == 2 and "HOST:PORT" in capsys.readouterr().err
    code = cli.main(["ladder", "run", str(spec_path), "--ray", cluster.address,
                     "--cpus-per-run", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "asks for 4 CPUs but the largest node has 1" in err
    with pytest.raises(SystemExit):
        cli.main(["ladder", "run", str(spec_path), "--ray", "--max-retries", "-1"])
    assert "expected a finite number >= 0" in capsys.readouterr().err


@pytest.mark.slow  # ~2 min idle: 28 small runs in this process, then the same on 2 nodes
def test_mix_search_on_a_ray_cluster_equals_the_search_in_one_process(cluster, tmp_path,
                                                                     small_corpus, monkeypatch):
    pytest.importorskip("sklearn")
    for name, value in DRIVER_ENV.items():
        monkeypatch.setenv(name, value)
    args = ["--set", f"data.path={small_corpus}", "--set", "model.vocab_size=512", "--set",
            "model.d_model=32", "--set", "model.d_ff=32", "--set", "model.n_layers=1",
            "--set", "data.batch_size=4", "--set", "data.seq_len=32", "--proxy-steps", "3",
            "--eval-batches", "1"]
    here, there = tmp_path / "here", tmp_path / "there"
    assert cli.main(["data", "mix-search", "--out", str(here), *args]) == 0
    assert cli.main(["data", "mix-search", "--out", str(there), *args,
                     "--ray", cluster.address, "--stall-timeout", "300"]) == 0
    local, remote = (json.loads((d / "mix_search.json").read_text()) for d in (here, there))
    # every run is a pure function of its mixture and seeds: the same floats on any node
    for key in ("runs", "validation", "chosen_weights", "predicted_loss", "measured_loss"):
        assert remote[key] == local[key], key
    runs = sorted((there / "runs").iterdir())
    assert len(runs) == 24 + 4  # proxies and validation runs, each attempted once
    assert all(len(attempts(r)) == 1 for r in runs)
    # (which nodes took them is Ray's choice: 3-step proxies can all finish on the first
    # node before the second is offered one; the killed-node test covers two nodes)
