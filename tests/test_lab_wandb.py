"""The W&B mirror against the real wandb package: a short training run attached to a lab
experiment with MOELAB_WANDB=offline, read back with wandb's own reader of its transaction
log (`wandb leet inspect --json`). Every step and metric the lab store holds must be in
W&B with the same value, every event too, and nothing may need the network: where the
machine allows it, the training runs in a network namespace of its own with only a
loopback interface."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import yaml

from moelab.lab.store import Store

pytest.importorskip("wandb", reason="pip install -e '.[lab]'")


def no_network_prefix() -> list[str]:
    """A command prefix that runs its command with no network but loopback (wandb talks to
    its own service process over it), or [] where namespaces are not allowed."""
    prefix = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    if shutil.which("unshare") and shutil.which("ip") and subprocess.run(
            [*prefix, "true"], capture_output=True).returncode == 0:
        return prefix
    return []


@pytest.mark.slow  # a real training process plus wandb's service: ~30 s idle, minutes loaded
def test_offline_wandb_run_holds_every_logged_step_and_metric(tmp_path, write_config):
    lab = tmp_path / "lab.sqlite"
    config = write_config(train={"steps": 8, "log_every": 2, "eval_every": 4})
    with Store(lab) as store:  # the snapshot is the config the run uses, as `lab new` takes it
        exp = store.new_experiment("wandb mirror", "nothing lost",
                                   yaml.safe_load(config.read_text()), None)
    env = {**os.environ, "MOELAB_LAB": str(lab), "MOELAB_WANDB": "offline",
           "MOELAB_WANDB_PROJECT": "moelab-test", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true", "WANDB_API_KEY": ""}
    cmd = [sys.executable, "-m", "moelab.cli", "train", "--config", str(config),
           "--run-dir", str(tmp_path / "run"), "--experiment", exp]
    proc = subprocess.run([*no_network_prefix(), *cmd], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    logs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    inspect = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                              str(logs[0])], capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.strip()]
    history = {r["history"]["step"]["num"]: r["history"]["item"]
               for r in records if r["type"] == "history"}
    run_record = next(r["run"] for r in records if r["type"] == "run")
    exit_record = next(r["exit"] for r in records if r["type"] == "exit")

    with Store(lab, mode="ro") as store:
        (run,) = store.runs(exp)
        expected: dict[int, dict[str, float]] = {}
        for name, points in store.all_metrics(run.id).items():
            for step, value in points:
                expected.setdefault(step, {})[name] = value
        for event in store.events(run.id):
            expected.setdefault(event.step, {})[f"event/{event.kind}"] = 1.0
    assert run_record["display_name"] == run.id and exit_record["exit_code"] == 0
    assert set(history) == set(expected)  # every step, no extra one
    assert len(expected) >= 4  # steps 0, 2, 4, 6 at least: the test looks at real data
    for step, metrics in expected.items():
        logged = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert logged == metrics, step  # every metric, same float64 value


class FakeWandb:
    """Stands in for the wandb module: records each wandb.init's arguments."""

    def __init__(self) -> None:
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda **k: None)


def test_a_branch_is_mirrored_as_a_wandb_fork_of_its_parent(tmp_path, write_config,
                                                            monkeypatch):
    from moelab.cli import main
    from moelab.lab.mirror import wandb_id

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    lab = tmp_path / "lab.sqlite"
    monkeypatch.setenv("MOELAB_LAB", str(lab))
    monkeypatch.setenv("MOELAB_WANDB", "offline")
    config = write_config(train={"steps": 6, "checkpoint_every": 3})
    with Store(lab) as store:
        exp = store.new_experiment("fork", "a branch forks its parent's curve",
                                   yaml.safe_load(config.read_text()), None)
    parent, child = tmp_path / "parent", tmp_path / "child"
    assert main(["train", "--config", str(config), "--run-dir", str(parent),
                 "--experiment", exp]) == 0
    assert main(["train", "--config", str(config), "--run-dir", str(child),
                 "--from", f"{parent}@3", "--experiment", exp]) == 0
    with Store(lab, mode="ro") as store:
        parent_run, child_run = store.runs(exp)
    first, second = fake.inits
    assert first["id"] == wandb_id(lab, parent_run.id) and "fork_from" not in first
    assert second["id"] == wandb_id(lab, child_run.id) != first["id"]
    assert second["fork_from"] == f"{first['id']}?_step=3"
