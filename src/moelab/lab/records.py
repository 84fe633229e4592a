"""What the lab records: experiments, their runs, events and pre-registered predictions.

An experiment is the unit a reader cares about ("did qk-norm remove the spikes?"); runs
are attempts at it. Nothing is ever deleted: failed and abandoned work stays in the record,
because a lab that hides its failures cannot be trusted with its successes.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

from moelab.errors import UserError

ENDED = ("succeeded", "failed", "abandoned")
RUN_ENDED = ("succeeded", "failed")

# Legal experiment status moves. running -> running is another run attaching to it; a
# planned experiment can only be abandoned, since nothing ran that could succeed or fail.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "planned": ("running", "abandoned"),
    "running": ("running", *ENDED),
    **{status: () for status in ENDED},
}


@dataclass(frozen=True)
class Experiment:
    id: str
    name: str
    hypothesis: str
    config: dict[str, Any]  # snapshot taken when the experiment was planned
    git_commit: str | None  # code version; "+dirty" when tracked files had local edits
    status: str  # a key of TRANSITIONS
    outcome: str  # what happened, in words; required once the experiment has ended
    created_at: float  # unix seconds
    finished_at: float | None


@dataclass(frozen=True)
class Run:
    id: str
    experiment_id: str
    run_dir: str
    config: dict[str, Any]
    status: str  # "running" or one of RUN_ENDED; a crashed run stays "running"
    message: str
    started_at: float
    finished_at: float | None


@dataclass(frozen=True)
class Event:
    run_id: str
    step: int
    kind: str  # "restart", "spike", "divergence", "nan", "config_change", "resume", ...
    message: str
    created_at: float


@dataclass(frozen=True)
class Prediction:
    id: int
    experiment_id: str
    name: str
    value: float
    low: float
    high: float
    details: dict[str, Any]  # details["metric"] names the metric it predicts (default "loss")
    created_at: float

    @property
    def metric(self) -> str:
        return str(self.details.get("metric", "loss"))


def check_transition(experiment: Experiment, new_status: str) -> None:
    """Raise UserError unless `experiment` may move to `new_status`."""
    allowed = TRANSITIONS[experiment.status]
    if new_status not in allowed:
        fix = f"allowed: {', '.join(allowed)}" if allowed else "start a new experiment instead"
        raise UserError(
            f"experiment {experiment.id} is {experiment.status} and cannot become "
            f"{new_status}; {fix}"
        )


def current_git_commit() -> str | None:
    """HEAD of the working directory's git repository, or None outside one.

    "+dirty" is appended when tracked files differ from HEAD, since then the commit alone
    does not reproduce the code that ran.
    """
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()
