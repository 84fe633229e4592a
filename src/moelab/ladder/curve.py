"""What a schedule-aware law sees of a run at each step: lr-weighted tokens and annealing.

A loss curve is not a function of tokens alone: the same tokens at a decayed learning
rate give a lower loss (the WSD cooldown drop). Following Tissue et al. 2024 (loss as a
function of the learning-rate area S1 and the annealing area S2), the ladder describes
the state after t steps by

    S1(t) = tokens_per_step * sum_{i<t} lr_i / lr_peak     (lr-weighted tokens)
    S2(t) = tokens_per_step * sum_{i<t, i >= warmup} (lr_peak - lr_i) / lr_peak
    q(t)  = S2 / S1                                        (fraction of the area annealed)

and fits L = E + A (N/N0)^-a + B (S1/D0)^-b (1 - C q) (moelab.ladder.fit.fit_curve).
Tissue's law subtracts C * S2 itself, which grows with the decay's length: a target with
8x the rungs' tokens would be credited an 8x larger cooldown drop. Here the drop scales the
data term by the annealed fraction q instead, so runs with the same schedule shape get the
same relative drop, and the final point of a WSD run reduces to Chinchilla's L(N, D).
"""

from __future__ import annotations

import numpy as np

from moelab.config import Config


def schedule_areas(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """(S1, q), each [steps + 1]: the state after t = 0..steps optimizer steps."""
    from moelab.train.optimizer import lr_schedule

    steps = cfg.train.steps
    lr = np.asarray(lr_schedule(cfg.optim, steps)(np.arange(steps)), float) / cfg.optim.lr
    per_step = cfg.data.batch_size * cfg.data.seq_len
    annealed = np.where(np.arange(steps) >= cfg.optim.warmup_steps, 1.0 - lr, 0.0)
    s1 = per_step * np.concatenate([[0.0], np.cumsum(lr)])
    s2 = per_step * np.concatenate([[0.0], np.cumsum(np.maximum(annealed, 0.0))])
    q = np.divide(s2, s1, out=np.zeros_like(s1), where=s1 > 0)
    return s1, q
