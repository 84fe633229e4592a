"""Where a run's metrics and events go: JSONL files in the run dir, and the lab (a sink).

The JSONL files are the run's own record and always written; when the run is attached
to a lab experiment, every step and event is mirrored into the lab too (train/sink.py); a run
attached after it trained (`moelab lab attach`, or `--experiment` on a run started
without it) brings its record so far into the store first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moelab.train.metrics import EVENT_SPEC, METRIC_SPEC, JsonlLog
from moelab.train.rundir import EVENTS_FILE, METRICS_FILE
from moelab.train.sink import the_lab


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
        self.sink, self.run_id = None, None
        self._repair()  # before attaching: the lab gets the repaired record
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
        history = lambda: (self.metrics.read(), self.events.read())
        self.sink, changes = the_lab().attach(run_dir, experiment, config, snapshot_change,
                                               fork, history, lab)
        self.run_id = self.sink.run_id
        if changes:
            changed = {k: {"old": a, "new": b} for k, (a, b) in changes.items()}
            self.event(0, "config_change", f"run config differs from experiment {experiment}'s "
                       f"snapshot: {json.dumps(changed)}")

    def step(self, step: int, record: dict) -> None:
        self.metrics.write({"step": step, **record})
        if self.sink is not None:
            numbers = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
            self.sink.log_metrics(step, numbers)

    def event(self, step: int, kind: str, message: str) -> None:
        self.events.write({"step": step, "kind": kind, "message": message})
        if self.sink is not None:
            self.sink.log_event(step, kind, message)

    def finish(self, status: str, message: str = "") -> None:
        """End the lab run; a run that already ended (a finished run started again, which
        has nothing left to train) keeps its record."""
        if self.sink is not None:
            self.sink.finish(status, message)

    def last_record(self, step: int) -> dict:
        """The metrics logged for `step` (a finished run's summary), or {}."""
        return next((r for r in reversed(self.metrics.read()) if r.get("step") == step), {})

    def rewind_to(self, step: int) -> None:
        """Forget metrics of steps after `step`: they are about to be recomputed."""
        self.metrics.truncate_after(step)


def check_snapshot(run_dir: Path, experiment: str, config: dict, allow_change: bool) -> None:
    """The experiment's snapshot rule before a start creates anything (read-only; a run dir
    already attached to the lab is not checked again, as RunLog does not)."""
    the_lab().check(Path(run_dir), experiment, config, allow_change)
