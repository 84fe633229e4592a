"""The ladder's score: cross-entropy over the *whole* validation split, at every eval point.

The trainer's own validation averages `train.eval_batches` random windows, so two runs
with different batch sizes are scored on different text, and the sampling noise of a few
hundred windows (~0.5% of the loss) is as large as the differences a ladder fits. The
ladder therefore hands the trainer an evaluator (its `evaluator` hook) that scores the
model on every non-overlapping seq_len window of each source's val split, in order: the
same text for every run, whatever its batch or seed, and no sampling noise at all. The
trainer calls it every `train.eval_every` steps (the spec sets 1/evals of the run) and at
the last step, and logs the result as `val_loss/<source>`, so every run yields a curve.

With dropless dispatch a token's loss does not depend on the other rows of its batch, so
padding the last batch changes nothing; with capacity dispatch the drops (and so the
score) depend slightly on how windows are grouped, which is fixed here for all runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moelab.config import Config
from moelab.data.loader import read_meta
from moelab.data.shards import shard_path
from moelab.schema import load_tokens

ROWS = 16  # windows per forward pass


def windows(data_dir: str | Path, source: str, seq_len: int) -> np.ndarray:
    """int32 [n, seq_len + 1]: window k is tokens[k*S : k*S + S + 1] of the val stream."""
    stream = load_tokens(shard_path(data_dir, source, "val"))
    n = (len(stream) - 1) // seq_len
    rows = [stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(n)]
    return np.stack(rows).astype(np.int32) if rows else np.zeros((0, seq_len + 1), np.int32)


def row_losses_fn(cfg: Config) -> Callable[[Any, np.ndarray], Any]:
    """A jitted (model, batch [B, S+1]) -> mean next-token CE of each row [B]."""
    return _row_losses(cfg.train.dtype)


@functools.cache
def _row_losses(dtype_name: str) -> Callable[[Any, np.ndarray], Any]:
    # one jitted function per dtype, so runs of the same shapes (seed replicates) reuse
    # its compiled code instead of compiling it again
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from moelab.train.step import cast_floats

    dtype = jnp.dtype(dtype_name)

    @eqx.filter_jit
    def row_losses(model, batch):
        logits, _, _ = cast_floats(model, dtype)(batch[:, :-1])
        logits = logits.astype(jnp.float32)  # the CE in f32 whatever the compute dtype
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(lse - target, axis=-1)

    return row_losses


def make_evaluator(cfg: Config) -> Callable[[Any], dict[str, float]]:
    """model -> {"val_loss/<source>": mean CE over every val window of that source}."""
    sources = read_meta(cfg.data.path)["sources"]
    rows = {s: windows(cfg.data.path, s, cfg.data.seq_len) for s in sources}
    rows = {s: r for s, r in rows.items() if len(r)}
    row_losses = row_losses_fn(cfg)

    def evaluate(model) -> dict[str, float]:
        out = {}
        for source, source_rows in rows.items():
            n, losses = len(source_rows), []
            for start in range(0, n, ROWS):
                # always ROWS rows (one compiled shape): the last batch wraps to the start
                batch = source_rows[np.arange(start, start + ROWS) % n]
                losses.append(np.asarray(row_losses(model, batch))[: n - start])
            out[f"val_loss/{source}"] = float(np.concatenate(losses).mean())
        return out

    return evaluate
