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
    details: dict[str, Any]  # details["metric"] names the metric it predicts (default "loss");
    # details["run"] the run it is scored on (a run id or run directory), or details["rule"]
    # how the experiment's runs are combined (SCORING_RULES); see `scored_by`
    created_at: float

    @property
    def metric(self) -> str:
        return str(self.details.get("metric", "loss"))

    @property
    def scored_by(self) -> tuple[str, str]:
        """("run", its id or directory) or ("rule", best | mean | last). Predictions from
        before runs were named fall back to "last": the last run that logged the metric,
        which makes the score depend on run order, so new ones must name one or the other."""
        if "run" in self.details:
            return "run", str(self.details["run"])
        return "rule", str(self.details.get("rule", "last"))


# How a prediction is scored when it names no single run: "best" the lowest last value of
# the experiment's runs (the lab's metrics are losses), "mean" their mean, "last" the last
# run that logged the metric (only what old, unnamed predictions get).
SCORING_RULES = ("best", "mean", "last")


def check_scoring(details: dict[str, Any]) -> None:
    """A prediction names at most one of a run and a rule, the rule a known one, and a
    metric that is not blank."""
    if "run" in details and "rule" in details:
        raise UserError(f"a prediction is scored on one run or by one rule, not both: got "
                        f"run {details['run']!r} and rule {details['rule']!r}")
    if "run" in details and not (isinstance(details["run"], str) and details["run"].strip()):
        raise UserError(f"prediction run: expected a run id or run directory, got "
                        f"{details['run']!r}")
    if "metric" in details and not (isinstance(details["metric"], str)
                                    and details["metric"].strip()):
        raise UserError(f"prediction metric: expected the name of a logged metric (val_loss, "
                        f"say), got {details['metric']!r}: it could never be scored")
    if "rule" in details and details["rule"] not in SCORING_RULES:
        raise UserError(f"prediction rule {details['rule']!r}: one of "
                        f"{', '.join(SCORING_RULES)}")


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
