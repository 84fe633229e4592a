"""The lab's records and SQLite store: status rules, durability, immutable predictions,
clear errors for bad files, and the optional W&B mirror."""

from __future__ import annotations

import math
import signal
import sqlite3
import subprocess
import sys
import types
from pathlib import Path

import pytest

from moelab.errors import UserError
from moelab.lab.records import current_git_commit
from moelab.lab.store import Store, default_lab_path


@pytest.fixture
def store(tmp_path: Path):
    with Store(tmp_path / "lab.sqlite") as store:
        yield store


def planned(store: Store, name: str = "baseline") -> str:
    return store.new_experiment(name, "loss goes down", {"train": {"steps": 10}}, "abc123")


def running(store: Store) -> tuple[str, str]:
    exp_id = planned(store)
    return exp_id, store.start_run(exp_id, "runs/a", {"seed": 0})


# --------------------------------------------------------------------- status rules


def test_experiment_goes_planned_running_succeeded(store):
    exp_id = planned(store)
    assert store.get_experiment(exp_id).status == "planned"
    first = store.start_run(exp_id, "runs/a", {})
    second = store.start_run(exp_id, "runs/b", {})  # a retry attaches to the same experiment
    assert store.get_experiment(exp_id).status == "running"
    store.finish_run(first, "failed", "diverged at step 40")
    store.finish_run(second, "succeeded")
    store.finish_experiment(exp_id, "succeeded", "loss 2.1, inside the predicted band")
    ended = store.get_experiment(exp_id)
    assert (ended.status, ended.outcome) == ("succeeded", "loss 2.1, inside the predicted band")
    assert ended.finished_at is not None
    with pytest.raises(UserError, match="start a new experiment"):
        store.start_run(exp_id, "runs/c", {})


def test_planned_experiment_can_only_be_abandoned(store):
    exp_id = planned(store)
    for status in ("succeeded", "failed"):
        with pytest.raises(UserError, match="is planned and cannot become"):
            store.finish_experiment(exp_id, status, "nothing ran")
    store.finish_experiment(exp_id, "abandoned", "superseded by exp-2")
    assert store.get_experiment(exp_id).status == "abandoned"


@pytest.mark.parametrize("first", ["succeeded", "failed", "abandoned"])
def test_ended_experiment_cannot_change(store, first):
    exp_id, _ = running(store)
    store.finish_experiment(exp_id, first, "done")
    for status in ("succeeded", "failed", "abandoned"):
        with pytest.raises(UserError, match=f"is {first} and cannot become {status}"):
            store.finish_experiment(exp_id, status, "again")


def test_outcome_and_status_are_checked(store):
    exp_id, _ = running(store)
    for blank in ("", "   \n"):
        with pytest.raises(UserError, match="outcome is required"):
            store.finish_experiment(exp_id, "failed", blank)
    with pytest.raises(UserError, match="an experiment ends as one of"):
        store.finish_experiment(exp_id, "running", "still going")
    assert store.get_experiment(exp_id).status == "running"


def test_run_ends_once(store):
    _, run_id = running(store)
    with pytest.raises(UserError, match="a run ends as one of"):
        store.finish_run(run_id, "abandoned")
    store.finish_run(run_id, "failed", "NaN at step 12")
    with pytest.raises(UserError, match="already ended as failed"):
        store.finish_run(run_id, "succeeded")


def test_failed_and_abandoned_work_stays_listed(store):
    failed, run_id = running(store)
    store.finish_run(run_id, "failed", "loss spiked to 40")
    store.finish_experiment(failed, "failed", "diverged without qk-norm")
    abandoned = planned(store, "moe-64")
    store.finish_experiment(abandoned, "abandoned", "out of memory budget")
    listed = {e.id: e.status for e in store.list_experiments()}
    assert listed == {failed: "failed", abandoned: "abandoned"}
    [run] = store.runs(failed)
    assert (run.status, run.message) == ("failed", "loss spiked to 40")


def test_unknown_ids_name_the_fix(store):
    with pytest.raises(UserError, match="no experiment 'exp-9'.*moelab lab list"):
        store.start_run("exp-9", "runs/a", {})
    with pytest.raises(UserError, match="name is required"):
        store.new_experiment(" ", "h", {}, None)


# ------------------------------------------------------------------ metrics, durability


def test_failing_log_call_leaves_no_partial_step(store):
    _, run_id = running(store)
    store.log_metrics(run_id, 1, {"loss": 3.0, "ce": 2.9})
    with pytest.raises(UserError, match="'bad'"):
        store.log_metrics(run_id, 2, {"loss": 2.5, "ce": 2.4, "bad": "oops"})
    assert store.metrics(run_id, "loss") == [(1, 3.0)]
    assert store.latest(run_id) == {"loss": (1, 3.0), "ce": (1, 2.9)}


def test_nan_and_inf_survive_and_relogged_steps_replace(store):
    _, run_id = running(store)
    store.log_metrics(run_id, 1, {"loss": math.nan, "grad_norm": math.inf})
    store.log_metrics(run_id, 2, {"loss": 4.0})
    store.log_metrics(run_id, 2, {"loss": 3.5})  # resumed from step 1, step 2 again
    [(_, nan), (step, value)] = store.metrics(run_id, "loss")
    assert math.isnan(nan) and (step, value) == (2, 3.5)
    assert store.metrics(run_id, "grad_norm") == [(1, math.inf)]


def test_sigkill_loses_at_most_the_step_being_written(tmp_path):
    """A trainer killed mid-run keeps every step it reported as logged, each complete."""
    path = tmp_path / "lab.sqlite"
    with Store(path) as store:
        _, run_id = running(store)
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys\nfrom moelab.lab.store import Store\n"
            f"store = Store({str(path)!r})\n"
            "for step in range(10**9):\n"
            f"    store.log_metrics({run_id!r}, step, {{'loss': 1.0, 'ce': 0.9, 'lr': 0.1}})\n"
            "    print(step, flush=True)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )
    for line in child.stdout:
        if int(line) >= 30:
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    reported = int(line)
    with Store(path, mode="ro") as store:
        steps = {name: [s for s, _ in store.metrics(run_id, name)] for name in ("loss", "ce", "lr")}
    assert steps["loss"] == steps["ce"] == steps["lr"]  # no step half-written
    assert steps["loss"][: reported + 1] == list(range(reported + 1))


# ---------------------------------------------------------------------------- events


def test_events_are_kept_in_step_order(store):
    _, run_id = running(store)
    store.log_event(run_id, 50, "restart", "resumed from step 40")
    store.log_event(run_id, 12, "spike", "grad norm 9.1, z=7")
    assert [(e.step, e.kind) for e in store.events(run_id)] == [(12, "spike"), (50, "restart")]


# ----------------------------------------------------------------------- predictions


def test_predictions_cannot_be_changed(store):
    exp_id = planned(store)
    pid = store.add_prediction(exp_id, "final loss", 2.0, 1.8, 2.3, {"metric": "loss"})
    assert not [name for name in dir(store) if "update" in name or "delete" in name]
    raw = sqlite3.connect(store.path)
    for sql in ("UPDATE predictions SET value = 9 WHERE id = ?",
                "DELETE FROM predictions WHERE id = ?"):
        with pytest.raises(sqlite3.IntegrityError, match="pre-registered"):
            raw.execute(sql, (pid,))
    raw.close()
    [kept] = store.predictions(exp_id)
    assert (kept.value, kept.low, kept.high, kept.metric) == (2.0, 1.8, 2.3, "loss")


def test_predictions_must_come_before_the_outcome(store):
    exp_id = planned(store)
    with pytest.raises(UserError, match="low <= value <= high"):
        store.add_prediction(exp_id, "loss", 3.0, 1.0, 2.0, {})
    store.finish_experiment(exp_id, "abandoned", "no budget")
    with pytest.raises(UserError, match="before the outcome is known"):
        store.add_prediction(exp_id, "loss", 2.0, 1.0, 3.0, {})


# ------------------------------------------------------------------------- bad files


def test_missing_lab_says_how_to_create_one(tmp_path):
    for mode in ("ro", "rw"):
        with pytest.raises(UserError, match="no lab database at .*moelab lab new"):
            Store(tmp_path / "nope.sqlite", mode=mode)


def test_corrupt_lab_gives_a_clear_message(tmp_path):
    path = tmp_path / "lab.sqlite"
    path.write_bytes(b"\x00garbage, not SQLite\xff" * 500)
    for mode in ("rwc", "ro"):
        with pytest.raises(UserError, match="not a readable moelab lab database"):
            Store(path, mode=mode)


def test_a_lab_path_that_is_a_directory_or_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="lab file .* is a directory"):
        Store(tmp_path)  # sqlite's "unable to open database file" before
    with pytest.raises(UserError, match="under .*afile, which is a file"):
        Store(tmp_path / "afile" / "lab.sqlite")  # mkdir's FileExistsError before
    assert (tmp_path / "afile").read_text() == "x"


def test_a_run_attached_to_another_lab_is_refused_by_name(store, tmp_path):
    """Resuming (train --experiment) or evaluating (eval longctx) a run whose lab_run.json
    names a run this lab lacks: one line naming both, not sqlite's foreign-key error."""
    from moelab.lab.sink import StoreLab

    exp_id, run_id = running(store)
    marker = tmp_path / "lab_run.json"
    marker.write_text(f'{{"run_id": "{run_id}", "experiment": "{exp_id}"}}')
    assert store.attached_run(marker) == run_id
    marker.write_text('{"run_id": "run-9", "experiment": "exp-1"}')
    with pytest.raises(UserError, match="names lab run 'run-9', which .*lab.sqlite does not"):
        store.attached_run(marker)
    with pytest.raises(UserError, match="attached to another lab"):
        StoreLab().attach(tmp_path, exp_id, {}, None, None, lambda: ([], []), store.path)


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as other:
        other.execute("CREATE TABLE notes (text)")
    with pytest.raises(UserError, match="not a moelab lab database"):
        Store(path)


def test_default_lab_path_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("MOELAB_LAB", raising=False)
    assert default_lab_path() == Path("runs/lab.sqlite")
    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "x.sqlite"))
    assert default_lab_path() == tmp_path / "x.sqlite"


def test_git_commit_is_recorded_with_dirty_flag(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert current_git_commit() is None
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = current_git_commit()
    assert len(head) == 40
    (tmp_path / "a.txt").write_text("2")
    assert current_git_commit() == head + "+dirty"


# ---------------------------------------------------------------------------- mirror


class FakeWandbRun:
    def __init__(self, **init):
        self.init, self.logged, self.exit_code = init, [], None

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self, exit_code):
        self.exit_code = exit_code


def test_wandb_mirror_copies_run_when_enabled(store, monkeypatch):
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("MOELAB_WANDB", "offline")
    exp_id, run_id = running(store)
    store.log_metrics(run_id, 3, {"loss": 2.0})
    store.log_event(run_id, 3, "spike", "z=8")
    store.finish_run(run_id, "failed", "diverged")
    [mirror] = runs
    assert (mirror.init["mode"], mirror.init["group"], mirror.init["name"]) == (
        "offline", exp_id, run_id)
    assert mirror.logged == [(3, {"loss": 2.0}), (3, {"event/spike": 1.0})]
    assert mirror.exit_code == 1


def test_wandb_mirror_off_by_default_and_clear_when_missing(store, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.delenv("MOELAB_WANDB", raising=False)
    exp_id, _ = running(store)
    monkeypatch.setenv("MOELAB_WANDB", "offline")
    with pytest.raises(UserError, match="wandb is not installed"):
        store.start_run(exp_id, "runs/b", {})
    assert len(store.runs(exp_id)) == 1  # the refused run left nothing behind
