"""The ladder's score: cross-entropy and bits per byte over the *whole* validation split.

The trainer's own validation averages `train.eval_batches` random windows, so two runs
with different batch sizes are scored on different text, and the sampling noise of a few
hundred windows (~0.5% of the loss) is as large as the differences a ladder fits. The
ladder therefore hands the trainer an evaluator (its `evaluator` hook) that scores the
model on every non-overlapping seq_len window of each source's val split, in order: the
same text for every run, whatever its batch or seed, and no sampling noise at all. The
trainer calls it every `train.eval_every` steps (the spec sets 1/evals of the run) and at
the last step, and logs the result as `val_loss/<source>` and `val_bpb/<source>` (with
`val_bpb_macro`), so every run yields a curve. The scoring itself is `moelab.eval.bpb`'s.

With dropless dispatch a token's loss does not depend on the other rows of its batch, so
padding the last batch changes nothing; with capacity dispatch the drops (and so the
score) depend slightly on how windows are grouped, which is fixed here for all runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from moelab.config import Config, data_dir
from moelab.eval.bpb import token_nll_fn, whole_split_evaluator

__all__ = ["make_evaluator", "row_losses_fn"]


def row_losses_fn(cfg: Config) -> Callable[[Any, np.ndarray], Any]:
    """A jitted (model, batch [B, S+1]) -> mean next-token CE of each row [B]."""
    token_nll = token_nll_fn(cfg.train.dtype)
    return lambda model, batch: token_nll(model, batch).mean(axis=-1)


def make_evaluator(cfg: Config) -> Callable[[Any], dict[str, float]]:
    """model -> {val_loss/<source>, val_bpb/<source>, val_bpb_macro, val_loss_mixture} over
    every val window. val_loss_mixture is the ladder's own score (fit.metric "loss": the
    sources' CE weighted by data.mixture), logged so the lab can score the ladder's
    prediction on the target's run."""
    from moelab.ladder.results import LOSS_MIXTURE, source_weights, weighted_loss

    weights = source_weights(cfg)
    evaluate = whole_split_evaluator(data_dir(cfg.data.path), cfg.data.seq_len,
                                     cfg.train.dtype)

    def with_mixture(model) -> dict[str, float]:
        scores = evaluate(model)
        return {**scores, LOSS_MIXTURE: weighted_loss(scores, weights)}

    return with_mixture
