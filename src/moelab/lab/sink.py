"""The lab's side of `moelab.train.sink`: a run attached to an experiment is a run in the
lab store, and its config is held to the experiment's snapshot (the open-lab rule)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moelab.config import config_from_dict, config_to_dict
from moelab.errors import ConfigError, UserError
from moelab.lab.store import Store, default_lab_path
from moelab.schema import read_json
from moelab.train.rundir import LAB_RUN_FILE, config_changes


class StoreRun:
    """A RunSink writing to one run of a lab store."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id

    def log_metrics(self, step: int, numbers: dict[str, float]) -> None:
        self.store.log_metrics(self.run_id, step, numbers)

    def log_event(self, step: int, kind: str, message: str) -> None:
        self.store.log_event(self.run_id, step, kind, message)

    def finish(self, status: str, message: str) -> None:
        if self.store.get_run(self.run_id).status == "running":
            self.store.finish_run(self.run_id, status, message)


class StoreLab:
    """The Lab of `moelab.train.sink`: the store at `lab` (default `default_lab_path()`)."""

    def check(self, run_dir: Path, experiment: str, config: dict, allow_change: bool) -> None:
        if (Path(run_dir) / LAB_RUN_FILE).exists():
            return
        with Store(default_lab_path(), mode="ro") as store:
            snapshot_changes(store, experiment, config, allow_change)

    def attach(self, run_dir: Path, experiment: str, config: dict,
               snapshot_change: bool | None, fork: tuple[Path, int] | None,
               history: Callable[[], tuple[list[dict], list[dict]]],
               lab: Path | None) -> tuple[StoreRun, dict[str, tuple[Any, Any]]]:
        store = Store(lab or default_lab_path())
        marker = run_dir / LAB_RUN_FILE
        if marker.exists():
            return StoreRun(store, store.attached_run(marker)), {}
        changes = ({} if snapshot_change is None else
                   snapshot_changes(store, experiment, config, snapshot_change))
        # the run dir's record is written inside the store's transaction: a run dir that
        # cannot take it leaves no run in the lab, and a retry makes exactly one
        run_id = store.start_run(
            experiment, str(run_dir), config, _parent_run(store, fork),
            claim=lambda run_id: marker.write_text(
                json.dumps({"run_id": run_id, "experiment": experiment})))
        store.import_history(run_id, *history())
        return StoreRun(store, run_id), changes


def _parent_run(store: Store, fork: tuple[Path, int] | None) -> tuple[str, int] | None:
    """(parent's lab run id, step) when the parent is a run of this same lab file."""
    if fork is None or not (Path(fork[0]) / LAB_RUN_FILE).exists():
        return None
    parent = read_json(Path(fork[0]) / LAB_RUN_FILE, {"run_id": str})["run_id"]
    try:
        same = Path(store.get_run(parent).run_dir).resolve() == Path(fork[0]).resolve()
    except UserError:  # attached to another lab file: nothing here to fork from
        return None
    return (parent, fork[1]) if same else None


def snapshot_changes(store: Store, experiment: str, config: dict, allow_change: bool) -> dict:
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
