"""Loss and grad-norm spike detection with a rolling robust z-score.

For each new value x with a window W of recent normal values:
    z = (x - median(W)) / (1.4826 * MAD(W) + eps)      (1.4826 * MAD ~ std for Gaussians)
z > threshold flags a `spike`; `patience` flagged steps in a row, or a non-finite value,
flag a `divergence`. Median and MAD ignore a few wild points, so one spike neither hides
the next one nor makes normal noise look alarming. Flagged values stay out of the window,
so a divergence keeps being seen as one instead of becoming the new normal.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpikeDetector:
    window: int = 50
    threshold: float = 6.0
    patience: int = 5
    min_history: int = 10
    history: deque = field(default_factory=deque)
    run_length: int = 0

    def update(self, value: float) -> str | None:
        """Feed one step's value; returns None, "spike" or "divergence"."""
        if not math.isfinite(value):
            return "divergence"
        if len(self.history) < self.min_history:
            self._remember(value)
            return None
        if self.zscore(value) <= self.threshold:
            self.run_length = 0
            self._remember(value)
            return None
        self.run_length += 1
        return "divergence" if self.run_length >= self.patience else "spike"

    def zscore(self, value: float) -> float:
        values = np.asarray(self.history)
        median = float(np.median(values))
        mad = float(np.median(np.abs(values - median)))
        return (value - median) / (1.4826 * mad + 1e-8 * max(abs(median), 1.0))

    def _remember(self, value: float) -> None:
        self.history.append(value)
        if len(self.history) > self.window:
            self.history.popleft()

    def state_dict(self) -> dict:
        return {"history": list(self.history), "run_length": self.run_length}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"])
        self.run_length = int(state["run_length"])


# A model that predicts every token uniformly has cross-entropy ln(vocab_size); a freshly
# initialised one is within a few tenths of it. LOSS_MARGIN times that is a model whose
# mean log-probability of the right token is below that of a uniform guess over vocab^2
# outcomes: no training run passes through there, so a checkpoint that far gone is a
# divergence (finite or not), never a state worth resuming from.
LOSS_MARGIN = 3.0


def plausible_loss_bound(vocab_size: int) -> float:
    """The largest cross-entropy (nats) a checkpoint may be saved at: LOSS_MARGIN ln(V)."""
    return LOSS_MARGIN * math.log(vocab_size)


def diverging(detector: SpikeDetector) -> bool:
    """Whether the spike rule currently calls the series a divergence: its last
    `patience` values were all flagged."""
    return detector.run_length >= detector.patience


# Evaluations in a row at which a source's validation loss must rise (while the training
# loss falls) to call it overfitting: one rise is within an evaluation's noise, three in a
# row on the same text (the val windows are fixed) is a trend.
OVERFIT_EVALS = 3


@dataclass
class OverfitDetector:
    """Overfitting as an event, like a spike: a source's validation loss rose at each of
    the last `evals` evaluations while the training loss fell over the same span. The
    training loss of an evaluation is the mean CE of the steps since the one before (one
    step's loss is too noisy to say it fell). Flagged once per episode: again only after
    that source's validation loss has stopped rising."""

    evals: int = OVERFIT_EVALS
    train: list = field(default_factory=list)  # CE of the steps since the last evaluation
    history: list = field(default_factory=list)  # [train mean, {source: val loss}] per eval
    flagged: list = field(default_factory=list)  # sources in an episode already flagged

    def step(self, ce: float) -> None:
        self.train.append(ce)

    def evaluate(self, val: dict[str, float], repeated: set[str] | None = None
                 ) -> tuple[float | None, list[str]]:
        """Feed one evaluation's {source: val loss}; returns (the training loss it is
        compared with, None if no step trained since the last; sources overfitting now).
        `repeated`: the sources the run has passed over more than once by now (None: not
        known, every source may be flagged). Only those can overfit: before its second
        pass a source's training tokens are all new, so a validation loss that rises then
        (a high learning rate, a mixture moving away from it) is not memorisation."""
        if not self.train:  # evaluated twice at one step (a resume): nothing new to compare
            return None, []
        train = float(np.mean(self.train))
        self.train = []
        self.history = [*self.history, [train, dict(val)]][-(self.evals + 1):]
        if len(self.history) <= self.evals:
            return train, []
        first_train, last_train = self.history[0][0], self.history[-1][0]
        rising = [s for s in val if all(
            s in a[1] and s in b[1] and b[1][s] > a[1][s]
            for a, b in zip(self.history, self.history[1:], strict=False))]
        self.flagged = [s for s in self.flagged if s in rising]  # an episode ended: re-arm
        new = [s for s in rising if s not in self.flagged
               and (repeated is None or s in repeated)] if last_train < first_train else []
        self.flagged += new
        return train, new

    def state_dict(self) -> dict:
        return {"train": list(self.train), "history": self.history, "flagged": self.flagged}

    def load_state_dict(self, state: dict) -> None:
        self.train = list(state["train"])
        self.history = [list(h) for h in state["history"]]
        self.flagged = list(state["flagged"])
