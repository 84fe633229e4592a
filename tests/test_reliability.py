"""Fault injection: damaged checkpoints, signals, torn logs, full disks, a second trainer.

Runs train in this process (a resume costs ~3 s, not a fresh JAX import) except where the
fault is about processes. Every recovery is judged the same way: the losses after it equal,
bit for bit, those of a run that never saw the fault (determinism makes that exact).
"""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from moelab.cli import main
from moelab.config import config_from_dict, config_to_dict, load_config, replace
from moelab.errors import DivergenceError, Interrupted, UserError
from moelab.train.checkpoint import INTEGRITY_FILE, Checkpointer, load_latest, write_integrity
from moelab.train.cli import default_run_dir
from moelab.train.metrics import JsonlLog
from moelab.train.rundir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EVENTS_FILE,
    LAB_RUN_FILE,
    METRICS_FILE,
    QUARANTINE_DIR,
    WORKER_PID_FILE,
    RunDirLock,
    current_config_path,
)
from moelab.train.trainer import Trainer, train

STEPS = 12  # checkpoints at 4, 8, 12, all three kept


@pytest.fixture(scope="module")
def cfg(small_corpus):
    from conftest import tiny_config

    # Each Trainer jits its step afresh: the disk cache (conftest) makes the recompiles cheap.
    return config_from_dict(tiny_config(small_corpus, train={"keep_checkpoints": 3}))


@pytest.fixture(scope="module")
def clean(cfg, tmp_path_factory) -> Path:
    """A finished run that never saw a fault: the reference for every recovery."""
    run = tmp_path_factory.mktemp("clean") / "run"
    train(cfg, run)
    return run


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in JsonlLog(run / METRICS_FILE).read()}


def kinds(run: Path) -> list[tuple[str, int]]:
    """(kind, step) of the run's events, without spike flags: those follow the data's loss
    curve (a 12-step run on a small corpus may flag one), not what these tests check."""
    return [(e["kind"], e["step"]) for e in JsonlLog(run / EVENTS_FILE).read()
            if e["kind"] != "spike"]


def copy_run(clean: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(clean, run)
    return run


def largest_array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def garble(path: Path) -> None:
    """4 KB (or half the file) of random bytes in the middle of the file."""
    data = bytearray(path.read_bytes())
    n = min(4096, len(data) // 2)
    start = (len(data) - n) // 2
    data[start:start + n] = random.Random(0).randbytes(n)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty_dir(path: Path) -> None:
    shutil.rmtree(path)
    path.mkdir()


DAMAGE = {
    "garbled_array": lambda d: garble(largest_array_file(d)),
    "truncated_array": lambda d: truncate(largest_array_file(d)),
    "empty_state": lambda d: empty_dir(d / "state"),
    "missing_metadata": lambda d: (d / "meta" / "metadata").unlink(),
    "garbled_metadata": lambda d: (d / "meta" / "metadata").write_bytes(b'{"config": \x00\xff'),
    "no_integrity_record": lambda d: (d / INTEGRITY_FILE).unlink(),
    # orbax's own step record, read for every step when the checkpoints are opened: two
    # keys damaged in it (as a fuzz test found) fail the opening itself, before any step
    # is chosen
    "garbled_orbax_step_record": lambda d: (d / "_CHECKPOINT_METADATA").write_bytes(
        (d / "_CHECKPOINT_METADATA").read_bytes().replace(b'"item_', b'"iuem_')
        .replace(b'"performance_', b'"(erformance_')),
    # Damage that happened before the record was written: only the restore can notice.
    "truncated_then_recorded": lambda d: (truncate(largest_array_file(d)), write_integrity(d)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_previous_good_one(
        damage, cfg, clean, tmp_path, capfd):
    run = copy_run(clean, tmp_path)
    DAMAGE[damage](run / CHECKPOINT_DIR / "12")
    assert train(cfg, run)["step"] == STEPS
    err = capfd.readouterr().err
    assert "checkpoint 12 is damaged" in err and "moved aside" in err, err
    assert ("resume", 8) in kinds(run)
    assert losses(run) == losses(clean)  # steps 9..12 recomputed bit for bit
    aside = list((run / QUARANTINE_DIR).iterdir())
    assert [p.name.split("-")[0] for p in aside] == ["12"]  # moved, not deleted
    # The recomputed checkpoint 12 verifies again.
    assert main(["checkpoint", "verify", str(run)]) == 0


def test_readers_skip_damage_without_moving_it_and_verify_lists_it(clean, tmp_path, capfd):
    run = copy_run(clean, tmp_path)
    garble(largest_array_file(run / CHECKPOINT_DIR / "12"))
    model, _, step = load_latest(run)  # what export, generate and the ladder use
    assert step == 8
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(model) if
               isinstance(x, jax.Array))
    assert (run / CHECKPOINT_DIR / "12").is_dir()  # a reader changes nothing
    capfd.readouterr()
    assert main(["checkpoint", "verify", str(run)]) == 1
    lines = capfd.readouterr().out.splitlines()
    assert lines[:2] == ["step 4: good", "step 8: good"]
    assert lines[2].startswith("step 12: BAD: state/") and "sha256" in lines[2]


def test_a_reader_names_a_step_whose_orbax_record_is_damaged(clean, tmp_path):
    run = copy_run(clean, tmp_path)
    DAMAGE["garbled_orbax_step_record"](run / CHECKPOINT_DIR / "8")
    with pytest.raises(UserError, match="checkpoint 8: _CHECKPOINT_METADATA does not match"):
        load_latest(run)  # orbax cannot open the run; a reader must not move anything
    assert (run / CHECKPOINT_DIR / "8").is_dir()


def test_every_checkpoint_damaged_is_a_clear_error(cfg, clean, tmp_path):
    run = copy_run(clean, tmp_path)
    for step in (4, 8, 12):
        (run / CHECKPOINT_DIR / str(step) / INTEGRITY_FILE).unlink()
    with pytest.raises(UserError, match="every checkpoint .* is damaged"):
        load_latest(run)
    with pytest.raises(UserError, match="every checkpoint .* is damaged"):
        train(cfg, run)
    assert len(list((run / QUARANTINE_DIR).iterdir())) == 3  # all kept, aside


def test_non_finite_parameters_are_never_checkpointed(tmp_path):
    saver = Checkpointer(tmp_path, keep=2)
    with pytest.raises(DivergenceError, match="1 of 2 .* non-finite .* step 3; not saving"):
        saver.save(3, {"w": jnp.array([1.0, jnp.inf])}, [jnp.zeros(2)], {"step": 3})
    assert saver.latest_step() is None


def test_interrupted_save_remains_are_removed_on_start(tmp_path, capsys):
    stale = tmp_path / CHECKPOINT_DIR / "8.orbax-checkpoint-tmp-1234"
    stale.mkdir(parents=True)
    Checkpointer(tmp_path, keep=2)
    assert not stale.exists() and "interrupted checkpoint save" in capsys.readouterr().out


def test_sigterm_at_a_random_step_saves_and_resumes_without_redoing_a_step(
        cfg, clean, tmp_path, monkeypatch, capsys):
    before = signal.getsignal(signal.SIGTERM)  # another library (Ray) may own it
    at = random.randrange(1, STEPS)  # any step must work; printed on failure
    flag = Trainer._flag_spikes
    queued = []  # the step the trainer had queued when the signal came

    def signal_at(self, step, record):
        flag(self, step, record)
        if step == at:
            queued.append(self.step)
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, through the real handler

    monkeypatch.setattr(Trainer, "_flag_spikes", signal_at)
    run = tmp_path / "run"
    with pytest.raises(Interrupted) as stop:
        train(cfg, run)
    # Metrics are checked one step late, so step `at` or the one already queued after it
    # is the step in flight: it finishes and is saved, nothing after it runs.
    (done,) = queued
    assert done in (at, at + 1), f"step {at}"
    assert str(stop.value) == (f"interrupted at step {done}; checkpoint {done} saved; rerun "
                               "the same command to resume")
    assert max(losses(run)) == done
    monkeypatch.setattr(Trainer, "_flag_spikes", flag)
    train(cfg, run)
    assert kinds(run)[:2] == [("interrupted", done), ("resume", done)], f"step {at}"
    assert losses(run) == losses(clean), f"SIGTERM at step {at}"
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored


def test_a_second_trainer_on_a_run_dir_is_refused(cfg, tmp_path):
    run = tmp_path / "run"
    with RunDirLock(run):  # the first trainer, as far as the lock can tell
        with pytest.raises(UserError, match=f"in use by another trainer \\(pid {os.getpid()}\\)"):
            train(cfg, run)
    assert not (run / METRICS_FILE).exists()


def test_torn_metrics_line_is_reported_cut_and_the_run_resumes(cfg, clean, tmp_path, capfd):
    run = copy_run(clean, tmp_path)
    # As if SIGKILLed while writing step 11: checkpoint 12 never existed, line 11 is torn.
    shutil.rmtree(run / CHECKPOINT_DIR / "12")
    kept = b"".join(line for line in (run / METRICS_FILE).read_bytes().splitlines(True)[:10])
    (run / METRICS_FILE).write_bytes(kept + b'{"step": 11, "loss": 5.9')
    assert [r["step"] for r in JsonlLog(run / METRICS_FILE).read()] == list(range(1, 11))
    train(cfg, run)
    assert "removed a torn last line" in capfd.readouterr().err
    assert ("torn_line", 10) in kinds(run)
    assert losses(run) == losses(clean)


def test_jsonl_torn_only_at_the_end(tmp_path):
    log = JsonlLog(tmp_path / "m.jsonl")
    log.write({"step": 1})
    with open(log.path, "ab") as f:
        f.write(b'{"step": 2')
    assert log.read() == [{"step": 1}]
    assert log.repair() == b'{"step": 2'
    assert log.path.read_bytes() == b'{"step": 1}\n'
    log.path.write_bytes(b'{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        log.read()


# ------------------------------------------------------------------------- run identity


def test_a_changed_config_is_refused_naming_fields_and_leaves_the_run_untouched(
        cfg, clean, tmp_path):
    run = copy_run(clean, tmp_path)
    before = (run / CONFIG_FILE).read_bytes()
    changed = replace(cfg, optim={"lr": 1e-3}, train={"eval_every": 3})
    with pytest.raises(UserError, match=r"optim.lr: run 0.003, now 0.001; train.eval_every: "
                                        r"run 6, now 3.*--allow-config-change"):
        train(changed, run)
    assert (run / CONFIG_FILE).read_bytes() == before
    assert losses(run) == losses(clean)


def test_an_allowed_change_is_recorded_and_a_no_op_resume_reports_the_final_metrics(
        cfg, clean, tmp_path):
    run = copy_run(clean, tmp_path)
    changed = replace(cfg, train={"log_every": 3})
    summary = train(changed, run, allow_config_change=True)
    assert summary["loss"] == losses(clean)[STEPS]  # the run's own last loss, not NaN
    change = [e for e in JsonlLog(run / EVENTS_FILE).read() if e["kind"] == "config_change"]
    assert len(change) == 1 and '"train.log_every": {"old": 4, "new": 3}' in change[0]["message"]
    assert current_config_path(run).name == f"config.step-{STEPS}.yaml"
    assert load_config(current_config_path(run)) == changed
    train(changed, run)  # the accepted config is now the run's: no flag needed again


def test_experiment_refuses_a_run_config_that_differs_from_its_snapshot(
        cfg, tmp_path, monkeypatch):
    from moelab.lab.store import Store

    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "lab.sqlite"))
    exp = Store(tmp_path / "lab.sqlite").new_experiment("e", "h", config_to_dict(cfg), None)
    run = tmp_path / "run"
    with pytest.raises(UserError, match=f"differs from experiment {exp}'s snapshot "
                                        r"\(optim.lr: experiment 0.003, run 0.001\)"):
        train(replace(cfg, optim={"lr": 1e-3}), run, experiment=exp, match_experiment=True)
    assert not (run / CONFIG_FILE).exists() and not (run / LAB_RUN_FILE).exists()


def test_set_without_run_dir_gets_its_own_run_dir():
    assert default_run_dir("tiny", []) == Path("runs/tiny")
    assert default_run_dir("configs/a.yaml", ["optim.lr=1e-3", "train.steps=5"]) == \
        Path("runs/a-optim.lr=1e-3-train.steps=5")


def test_a_config_file_passed_as_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    """`moelab train my.yaml` meant a config: a missing one must not become a run dir
    named my.yaml (it trained there before), an existing one says to use --config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "given.yaml").write_text("train: {steps: 2}\n")
    assert main(["train", "missing.yaml"]) == 2
    assert "named like a config file" in capsys.readouterr().err
    assert not (tmp_path / "missing.yaml").exists()
    assert main(["train", "given.yaml"]) == 2
    assert "pass it as --config given.yaml" in capsys.readouterr().err


# ------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs to fill up; skipped where mounting is not allowed (not root, a
    container without CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill ({done.stderr.strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; deleting it makes the space return."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler


def test_disk_full_during_a_checkpoint_save_then_resume(cfg, clean, small_disk, monkeypatch):
    run, save = small_disk / "run", Checkpointer.save

    def full_at_8(self, step, *args):
        if step == 8 and not (small_disk / "filler").exists():
            fill(small_disk)
        return save(self, step, *args)

    monkeypatch.setattr(Checkpointer, "save", full_at_8)
    with pytest.raises(OSError) as err:
        train(cfg, run)
    assert err.value.errno == errno.ENOSPC and "checkpoint 8" in str(err.value)
    (small_disk / "filler").unlink()  # space returns
    monkeypatch.setattr(Checkpointer, "save", save)
    train(cfg, run)
    assert ("resume", 4) in kinds(run)
    assert not list((run / CHECKPOINT_DIR).glob("*tmp*"))
    assert losses(run) == losses(clean)


def test_disk_full_during_a_metrics_write_then_resume(cfg, clean, small_disk, monkeypatch):
    run, write = small_disk / "run", JsonlLog.write
    failed = []

    def full_when_a_page_is_needed(self, record):
        # tmpfs hands out whole pages: the disk being full only shows once a line
        # crosses into a new page of metrics.jsonl, so fill it just before that one.
        line = len(json.dumps(record)) + 1
        size = self.path.stat().st_size if self.path.exists() else 0
        if (self.path.name == METRICS_FILE and record["step"] >= 2 and not failed
                and size % 4096 + line > 4096):
            failed.append(record["step"])
            fill(small_disk)
        return write(self, record)

    monkeypatch.setattr(JsonlLog, "write", full_when_a_page_is_needed)
    with pytest.raises(OSError) as err:
        train(cfg, run)
    assert err.value.errno == errno.ENOSPC and failed
    assert max(losses(run)) == failed[0] - 1  # the torn line was cut back, nothing else
    (small_disk / "filler").unlink()
    monkeypatch.setattr(JsonlLog, "write", write)
    train(cfg, run)
    assert losses(run) == losses(clean)


# ------------------------------------------------------------------------- processes


@pytest.mark.slow  # a supervisor and its worker: two fresh processes, ~30 s each
@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_supervisor_stopped_or_killed_leaves_no_orphan_worker(kill, write_config, tmp_path):
    """SIGKILL: the kernel sends the worker its parent-death signal (SIGUSR1); SIGTERM:
    the supervisor forwards it. Either way the worker saves a checkpoint and stops."""
    config = write_config(train={"steps": 100_000, "checkpoint_every": 1000})
    run = tmp_path / "run"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "moelab.cli", "train", "--config", str(config), "--run-dir",
         str(run), "--max-restarts", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    # the worker is training: a logged step (the file alone may be made before its handler)
    while not ((run / METRICS_FILE).exists() and (run / METRICS_FILE).read_text().strip()):
        assert time.time() < deadline and supervisor.poll() is None
        time.sleep(0.1)
    worker = int((run / WORKER_PID_FILE).read_text())
    supervisor.send_signal(kill)
    _, err = supervisor.communicate(timeout=120)
    assert supervisor.returncode == (-9 if kill == signal.SIGKILL else 130), err
    deadline = time.time() + 120
    while Path(f"/proc/{worker}").exists() and "Z" not in _state(worker):
        assert time.time() < deadline, "the worker outlived its supervisor"
        time.sleep(0.1)
    events = kinds(run)
    assert events and events[-1][0] == "interrupted", (events, err)
    assert "restart" not in [k for k, _ in events]  # stopped, not crashed
    assert main(["checkpoint", "verify", str(run)]) == 0


PARENT = """
import os, subprocess, sys, threading, time
from moelab.train.supervisor import _die_with_parent
for _ in range(8):  # threads that exit after the main one when the process is killed
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
me = os.getpid()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                         start_new_session=True, preexec_fn=lambda: _die_with_parent(me))
print(child.pid, flush=True)
time.sleep(3600)
"""
CHILD = """
import sys, time
from pathlib import Path
from moelab.train.interrupt import StopRequest
with StopRequest() as stop:
    Path(sys.argv[1]).write_text("ready")
    while not stop.requested:
        time.sleep(0.01)
    time.sleep(0.5)  # "finishing the step": any repeat of the signal arrives in here
    Path(sys.argv[2]).write_text(str(stop.signal))
"""


@pytest.mark.parametrize("attempt", range(3))
def test_a_supervisor_death_delivered_many_times_still_stops_its_worker_gracefully(
        attempt, tmp_path):
    """The kernel sends the parent-death signal each time the worker is re-parented, and a
    killed parent with 9 threads re-parents it thread by thread: the signal can arrive
    several times at once. (As SIGTERM, the second copy read as "exit at once" and the
    worker left without its checkpoint: a flaky CI failure until this was found.)"""
    ready, done = tmp_path / "ready", tmp_path / "done"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(ready), str(done)],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.time() + 60
    while not ready.exists():
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.01)
    parent.kill()
    parent.wait()
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        assert time.time() < deadline, "the child outlived its parent"
        time.sleep(0.01)
    assert done.exists(), "the child exited without finishing its step"
    assert int(done.read_text()) == signal.SIGUSR1


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_an_interrupted_prepare_leaves_no_temporaries_after_the_next_one(tmp_path):
    from conftest import SMALL_SOURCES

    from moelab.data.prepare import prepare

    out = tmp_path / "data"
    out.mkdir()
    stale = out / ".meta.json.k3j9x.tmp"  # what a SIGKILL inside atomic_write leaves
    stale.write_bytes(b"half a file")
    prepare(out, SMALL_SOURCES, vocab_size=300, max_docs_per_source=20, workers=1)
    assert not stale.exists() and not list(out.rglob("*.tmp"))
    assert (out / "meta.json").exists()
