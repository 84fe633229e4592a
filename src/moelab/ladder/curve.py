"""What a schedule-aware law sees of a run at each step: lr-weighted tokens and annealing.

A loss curve is not a function of tokens alone: the same tokens at a decayed learning
rate give a lower loss (the WSD cooldown drop). Following Tissue et al. 2024 (loss as a
function of the learning-rate area S1 and the annealing area S2), the ladder describes
the state after t steps by

    S1(t) = sum_{i<t} tokens_i * lr_i / lr_peak                  (lr-weighted tokens)
    S2(t) = sum_{i<t, i >= warmup} tokens_i * (lr_peak - lr_i) / lr_peak   (annealing area)

with lr_i the LR the run really uses at step i: the plan-aware schedule
(`moelab.train.optimizer.run_schedule`), so a stage's restart (its new warmup, peak and
decay) is seen by the law, and tokens_i the stage's own batch x seq_len. Two laws of the
curve are fitted on these (moelab.ladder.fit.CURVE_FORMS):

- "q" (the default):  L = E + A (N/N0)^-a + B (S1/D0)^-b (1 - C q),  q = S2 / S1.
  The drop scales the data term by the annealed *fraction*, so runs with the same
  schedule shape get the same relative drop, and a WSD run's final point reduces to
  Chinchilla's L(N, D).
- "tissue" (Tissue et al.'s published form):  L = E + A (N/N0)^-a + B (S1/D0)^-b - C S2/D0.
  The drop grows with the decay's length in tokens: a target with 8x the rungs' tokens
  is credited an 8x larger cooldown drop.

bench/curve_law_study.py chose between them on rung-only backtests (fit on the early or
narrow rungs' points, predict the rest): "q" won on both of the project's stored rung sets
(bench/results/curve_law_study/curve_law_study.json), so it stays the default;
`fit.curve_law: tissue` selects the other.
"""

from __future__ import annotations

import numpy as np

from moelab.config import Config

# Repeated data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models", eq.
# 5): a token seen for the (1 + R)-th time is worth exp(-R / R_D*) of a fresh one, with
# R_D* = 15.39 fitted on their runs; D tokens drawn from U unique ones are worth
# D' = U + U R_D* (1 - exp(-(D / U - 1) / R_D*)) fresh tokens (D' = D up to one pass).
# Published, not fitted here: the rungs rarely pass over the corpus, the target may.
REPEAT_DECAY = 15.39


def effective_tokens(tokens, unique: float | None) -> np.ndarray:
    """D': what `tokens` drawn from `unique` distinct ones are worth (None: D itself)."""
    d = np.asarray(tokens, float)
    if unique is None:
        return d
    repeats = np.maximum(d / unique - 1.0, 0.0)
    return np.minimum(d, unique) + unique * REPEAT_DECAY * (1 - np.exp(-repeats / REPEAT_DECAY))


def schedule_areas(cfg: Config, unique: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2), each [steps + 1]: the state after t = 0..steps optimizer steps. With
    `unique` (the corpus's distinct training tokens) each step's tokens count at what they
    are worth once repeated (REPEAT_DECAY), so S1 at the end is the effective D'."""
    from moelab.train.optimizer import run_schedule

    steps = cfg.train.steps
    lr = np.asarray(run_schedule(cfg)(np.arange(steps)), float) / cfg.optim.lr
    plan = cfg.plan
    per_step = np.array([plan.at(i).batch_size * plan.at(i).seq_len for i in range(steps)],
                        float)
    if unique is not None:  # each step's worth: D' after it minus D' before it
        seen = np.concatenate([[0.0], np.cumsum(per_step)])
        per_step = np.diff(effective_tokens(seen, unique))
    annealed = np.where(np.arange(steps) >= cfg.optim.warmup_steps, 1.0 - lr, 0.0)
    s1 = np.concatenate([[0.0], np.cumsum(per_step * lr)])
    s2 = np.concatenate([[0.0], np.cumsum(per_step * np.maximum(annealed, 0.0))])
    return s1, s2


def annealed_fraction(s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    """q = S2 / S1 (0 where S1 is 0)."""
    s1, s2 = np.asarray(s1, float), np.asarray(s2, float)
    return np.divide(s2, s1, out=np.zeros(np.broadcast(s1, s2).shape), where=s1 > 0)
