"""The trainer: exact resume after a real SIGKILL, supervision, bad input, metrics."""

import json
import os
import subprocess
import sys
import time

from conftest import THREE_STAGES, events, losses, moelab_train

from moelab.train.trainer import FAULT_ENV


def test_sigkill_mid_run_then_rerun_resumes_with_identical_losses(tmp_path, write_config):
    config = write_config()
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    moelab_train(config, clean)
    killed = moelab_train(config, crashed, env={FAULT_ENV: "7"}, check=False)
    assert killed.returncode == -9  # really killed, between checkpoints 4 and 8
    # Metrics are fetched one step late (the host runs a step ahead), so a kill before
    # step 8 is dispatched has logged steps 1..6: step 7's are still on the device.
    assert max(losses(crashed)) == 6
    resumed = moelab_train(config, crashed)
    assert "resumed from checkpoint at step 4" in resumed.stdout
    assert losses(crashed) == losses(clean)  # bitwise equal floats, steps 1..12
    # spike flags follow the loss curve (deterministic, in both runs); the rest is the resume
    assert [e["kind"] for e in events(crashed) if e["kind"] != "spike"] == ["resume"]


def test_sigkill_at_stage_boundaries_resumes_bitwise(tmp_path, write_config):
    """Stages start at steps 12 and 24 (the second with a fresh optimizer and an LR restart);
    checkpoints every 5 steps plus the permanent ones at 12 and 24. Kills land on both
    boundary steps and the step after the second, so resumed processes start each stage
    (the fresh optimizer included) from the boundary checkpoint."""
    config = write_config(stages=THREE_STAGES, train={
        "steps": 30, "checkpoint_every": 5, "keep_checkpoints": 1, "eval_every": 10,
        "keep_stage_checkpoints": True})
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    moelab_train(config, clean)
    resumed_from = []
    for fault in ("12", "24", "25"):
        killed = moelab_train(config, crashed, env={FAULT_ENV: fault}, check=False)
        assert killed.returncode == -9, killed.stderr
        resumed_from += [line for line in killed.stdout.splitlines() if "resumed" in line]
    finished = moelab_train(config, crashed)
    resumed_from += [line for line in finished.stdout.splitlines() if "resumed" in line]
    assert resumed_from == [f"resumed from checkpoint at step {s}" for s in (12, 24, 25)]
    assert losses(crashed) == losses(clean)  # bitwise equal floats, steps 1..30
    stage_events = [e["step"] for e in events(crashed) if e["kind"] == "stage"]
    assert stage_events == [0, 12, 24]  # each stage announced once, however often resumed
    kept = sorted(int(p.name) for p in (crashed / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [12, 24, 30]  # rotation kept 1, plus the stage boundaries


def test_supervisor_recovers_from_an_external_sigkill(tmp_path, write_config):
    config = write_config(train={"steps": 200, "checkpoint_every": 5, "eval_every": 200})
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moelab.cli", "train", "--config", str(config), "--run-dir",
           str(run), "--max-restarts", "2", "--restart-backoff", "0.1"]
    supervisor = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and max(losses(run), default=0) >= 8):
        assert time.time() < deadline and supervisor.poll() is None
        time.sleep(0.05)
    os.kill(int((run / "worker.pid").read_text()), 9)  # the "hardware fault"
    _, err = supervisor.communicate(timeout=600)
    assert supervisor.returncode == 0, err
    assert "restart 1/2" in err
    kinds = [e["kind"] for e in events(run)]
    assert kinds[:2] == ["restart", "resume"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 201))  # every step exactly once: the rewind dropped repeats


def test_supervisor_gives_up_after_max_restarts(tmp_path, write_config):
    config = write_config(train={"checkpoint_every": 2})
    proc = moelab_train(config, tmp_path / "run", "--max-restarts", "1", "--restart-backoff",
                        "0.05", env={FAULT_ENV: "3"}, check=False)
    assert proc.returncode == 1
    assert "after 1 restarts; giving up" in proc.stderr
    kinds = [e["kind"] for e in events(tmp_path / "run")]
    assert kinds.count("restart") == 1 and kinds[-1] == "gave_up"


def test_divergence_stops_before_it_is_saved(tmp_path, write_config):
    """lr 1e30: the first update already leaves the plausible range (finite or not), so the
    save of step 1 is refused, the run stops with exit 3 and keeps no checkpoint of it."""
    config = write_config(optim={"lr": 1e30, "warmup_steps": 0, "clip_norm": 1e30},
                          train={"checkpoint_every": 1, "steps": 20})
    run = tmp_path / "run"
    proc = moelab_train(config, run, check=False)
    assert proc.returncode == 3, proc.stderr
    stop = [e for e in events(run) if e["kind"] in ("save_refused", "nan")][0]
    assert stop["kind"] == "save_refused" and stop["step"] == 1, stop
    assert "refused to save checkpoint 1" in proc.stderr
    assert "no checkpoint passed before it" in proc.stderr
    kept = run / "checkpoints"
    assert not kept.exists() or not [p for p in kept.iterdir() if p.name.isdigit()]


def test_incompatible_checkpoint_and_missing_data_are_clear_errors(tmp_path, write_config):
    run = tmp_path / "run"
    moelab_train(write_config(train={"steps": 4}), run)
    wider = moelab_train(write_config(model={"d_model": 64}), run, check=False)
    assert wider.returncode == 2
    assert "incompatible config" in wider.stderr and "model.d_model" in wider.stderr
    missing = moelab_train(write_config(data={"path": str(tmp_path / "nothing")}),
                           tmp_path / "r2", check=False)
    assert missing.returncode == 2 and "moelab data prepare" in missing.stderr


def test_metrics_file_has_every_documented_field(tmp_path, write_config):
    run = tmp_path / "run"
    moelab_train(write_config(moe={"dispatch": "capacity", "capacity_factor": 1.0},
                              train={"steps": 6}), run)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("loss", "ce", "aux_loss", "seq_aux_loss", "router_z", "logit_z", "grad_norm", "lr",
                "tokens_per_s", "mfu", "drop_frac/layer_0", "drop_frac/layer_1",
                "expert_load_max_over_mean/layer_0", "val_loss/code", "val_loss/prose",
                "val_bpb/code", "val_bpb/prose", "val_bpb_macro"):
        assert key in last, key
    assert 0 < last["drop_frac/layer_0"] < 1 and last["mfu"] > 0
