"""How a run reports to the lab without importing it: the trainer calls a `Lab` (as
torchtitan's trainer calls the metrics logger it is given), and the lab layer registers
its implementation with `use_lab` when `moelab.lab` is imported. The CLI imports every
part, and a ladder's runs are started by code that imports the lab, so each process that
attaches a run to an experiment has one; train itself never imports upward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from moelab.errors import UserError


class RunSink(Protocol):
    """One run's record in the lab, attached: every step and event is mirrored there."""

    run_id: str

    def log_metrics(self, step: int, numbers: dict[str, float]) -> None: ...

    def log_event(self, step: int, kind: str, message: str) -> None: ...

    def finish(self, status: str, message: str) -> None:
        """End the lab run; one that already ended keeps its record."""


class Lab(Protocol):
    def check(self, run_dir: Path, experiment: str, config: dict, allow_change: bool) -> None:
        """Refuse (ConfigError) a config that differs from the experiment's snapshot unless
        allow_change; read-only, before a start creates anything; an attached run passes."""

    def attach(self, run_dir: Path, experiment: str, config: dict,
               snapshot_change: bool | None, fork: tuple[Path, int] | None,
               history: Callable[[], tuple[list[dict], list[dict]]],
               lab: Path | None) -> tuple[RunSink, dict[str, tuple[Any, Any]]]:
        """The run's lab record (the one its marker names, or a new one that imports
        `history()`: metrics and events so far) and the config changes accepted from the
        snapshot (snapshot_change: None attaches any config, False refuses a change)."""


_LAB: list[Lab] = []


def use_lab(lab: Lab) -> None:
    """Register the lab runs report to (`moelab.lab` registers the store's)."""
    _LAB[:] = [lab]


def the_lab() -> Lab:
    if not _LAB:
        raise UserError("a run attached to an experiment needs the lab, and none is loaded: "
                        "import moelab.lab first (the moelab CLI does)")
    return _LAB[0]
