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
