"""Where a run's metrics and events go: JSONL files in the run dir, and the lab store.

The JSONL files are the run's own record and always written; when the run is attached
to a lab experiment, every step and event is mirrored into its SQLite store too; a run
attached after it trained (`moelab lab attach`, or `--experiment` on a run started
without it) brings its record so far into the store first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moelab.config import config_from_dict, config_to_dict
from moelab.errors import ConfigError, UserError
from moelab.schema import read_json
from moelab.train.metrics import EVENT_SPEC, METRIC_SPEC, JsonlLog
from moelab.train.rundir import EVENTS_FILE, LAB_RUN_FILE, METRICS_FILE, config_changes


class RunLog:
    def __init__(self, run_dir: Path, experiment: str | None, config: dict,
                 snapshot_change: bool | None = None, lab: Path | None = None,
                 fork: tuple[Path, int] | None = None):
        """`snapshot_change`: None attaches whatever the config; False refuses a config that
        differs from the experiment's snapshot; True accepts and records the difference.
        `lab`: the lab file (default `default_lab_path()`). `fork`: (parent run dir, step)
        of a branch, whose W&B mirror then forks from the parent's."""
        self.metrics = JsonlLog(run_dir / METRICS_FILE, METRIC_SPEC)
        self.events = JsonlLog(run_dir / EVENTS_FILE, EVENT_SPEC)
        self.store, self.run_id = None, None
        self._repair()  # before attaching: the store gets the repaired record
        if experiment:
            self._attach(run_dir, experiment, config, snapshot_change, lab, fork)

    def _repair(self) -> None:
        """Cut lines torn by a kill or a full disk, and say so: appending after a torn
        line would glue two records into one unreadable line. Both logs are repaired
        before either repair is recorded: the event goes to events.jsonl, which may be
        torn too."""
        repaired = [(log.path.name, torn) for log in (self.metrics, self.events)
                    if (torn := log.repair())]
        for name, torn in repaired:
            message = (f"{name}: removed a torn last line ({len(torn)} bytes: "
                       f"{torn[:60]!r}), left by an interrupted write")
            print(message, file=sys.stderr, flush=True)
            last = self.metrics.read()
            self.event(last[-1]["step"] if last else 0, "torn_line", message)

    def _attach(self, run_dir: Path, experiment: str, config: dict,
                snapshot_change: bool | None, lab: Path | None,
                fork: tuple[Path, int] | None = None) -> None:
        from moelab.lab.store import Store, default_lab_path

        self.store = Store(lab or default_lab_path())
        marker = run_dir / LAB_RUN_FILE
        if marker.exists():
            self.run_id = read_json(marker, {"run_id": str})["run_id"]
            return
        changes = ({} if snapshot_change is None else
                   snapshot_changes(self.store, experiment, config, snapshot_change))
        # the run dir's record is written inside the store's transaction: a run dir that
        # cannot take it leaves no run in the lab, and a retry makes exactly one
        self.run_id = self.store.start_run(
            experiment, str(run_dir), config, self._parent_run(fork),
            claim=lambda run_id: marker.write_text(
                json.dumps({"run_id": run_id, "experiment": experiment})))
        self.store.import_history(self.run_id, self.metrics.read(), self.events.read())
        if changes:
            changed = {k: {"old": a, "new": b} for k, (a, b) in changes.items()}
            self.event(0, "config_change", f"run config differs from experiment {experiment}'s "
                       f"snapshot: {json.dumps(changed)}")

    def _parent_run(self, fork: tuple[Path, int] | None) -> tuple[str, int] | None:
        """(parent's lab run id, step) when the parent is a run of this same lab file."""
        if fork is None or not (Path(fork[0]) / LAB_RUN_FILE).exists():
            return None
        parent = read_json(Path(fork[0]) / LAB_RUN_FILE, {"run_id": str})["run_id"]
        try:
            same = Path(self.store.get_run(parent).run_dir).resolve() == Path(fork[0]).resolve()
        except UserError:  # attached to another lab file: nothing here to fork from
            return None
        return (parent, fork[1]) if same else None

    def step(self, step: int, record: dict) -> None:
        self.metrics.write({"step": step, **record})
        if self.store is not None:
            numbers = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
            self.store.log_metrics(self.run_id, step, numbers)

    def event(self, step: int, kind: str, message: str) -> None:
        self.events.write({"step": step, "kind": kind, "message": message})
        if self.store is not None:
            self.store.log_event(self.run_id, step, kind, message)

    def finish(self, status: str, message: str = "") -> None:
        """End the lab run; a run that already ended (a finished run started again, which
        has nothing left to train) keeps its record."""
        if self.store is not None and self.store.get_run(self.run_id).status == "running":
            self.store.finish_run(self.run_id, status, message)

    def last_record(self, step: int) -> dict:
        """The metrics logged for `step` (a finished run's summary), or {}."""
        return next((r for r in reversed(self.metrics.read()) if r.get("step") == step), {})

    def rewind_to(self, step: int) -> None:
        """Forget metrics of steps after `step`: they are about to be recomputed."""
        self.metrics.truncate_after(step)


def snapshot_changes(store, experiment: str, config: dict, allow_change: bool) -> dict:
    """The open-lab rule: a run attached to an experiment runs the config on record.
    Returns the differences (accepted only with `allow_change`)."""
    snapshot = config_to_dict(config_from_dict(store.get_experiment(experiment).config))
    changes = config_changes(snapshot, config)
    if changes and not allow_change:
        listed = "; ".join(f"{k}: experiment {a!r}, run {b!r}" for k, (a, b) in
                           changes.items())
        raise ConfigError(f"the config differs from experiment {experiment}'s snapshot "
                          f"({listed}); run its config, or pass --allow-config-change to "
                          "record the change")
    return changes


def check_snapshot(run_dir: Path, experiment: str, config: dict, allow_change: bool) -> None:
    """`snapshot_changes` before a start creates anything (read-only; a run dir already
    attached to the lab is not checked again, as RunLog does not)."""
    from moelab.lab.store import Store, default_lab_path

    if (Path(run_dir) / LAB_RUN_FILE).exists():
        return
    with Store(default_lab_path(), mode="ro") as store:
        snapshot_changes(store, experiment, config, allow_change)


def check_experiment(experiment: str, lab: Path | None = None) -> None:
    """A UserError naming `experiment` if the lab has no such experiment (read-only)."""
    from moelab.lab.store import Store, default_lab_path

    with Store(lab or default_lab_path(), mode="ro") as store:
        store.get_experiment(experiment)
