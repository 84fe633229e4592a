"""The whole-split evaluator: every window of each held-out domain's val split, scored in
bits per byte (the metric is defined in `moelab.train.bpb`, which the trainer reports)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moelab.data.loader import read_meta
from moelab.data.shards import shard_path
from moelab.train.bpb import domain_metrics, tokenizer_bytes

ROWS = 16  # windows per forward pass of the whole-split evaluator


def val_windows(data_dir: str | Path, source: str, seq_len: int) -> np.ndarray:
    """int32 [n, seq_len + 1]: window k is tokens[k*S : k*S + S + 1] of the val stream;
    the windows' targets tile the stream, so each token after the first is scored once."""
    stream = np.load(shard_path(data_dir, source, "val"), mmap_mode="r")
    n = (len(stream) - 1) // seq_len
    rows = [stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(n)]
    return np.stack(rows).astype(np.int32) if rows else np.zeros((0, seq_len + 1), np.int32)


@functools.cache
def token_nll_fn(dtype_name: str) -> Callable[[Any, np.ndarray], Any]:
    """A jitted (model, batch [B, S+1]) -> f32 [B, S] next-token NLL in nats.

    One per compute dtype, cached, so runs of the same shapes reuse the compiled code."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from moelab.train.step import cast_floats

    dtype = jnp.dtype(dtype_name)

    @eqx.filter_jit
    def token_nll(model, batch):
        logits, _, _ = cast_floats(model, dtype)(batch[:, :-1])
        logits = logits.astype(jnp.float32)  # the NLL in f32 whatever the compute dtype
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse - jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]

    return token_nll


def whole_split_evaluator(data_dir: str | Path, seq_len: int,
                          dtype: str = "float32") -> Callable[[Any], dict[str, float]]:
    """model -> {val_loss/<d>, val_bpb/<d>, val_bpb_macro} over *every* window of each
    domain's val split, in order: the same text for every run, no sampling noise.

    Always ROWS windows per forward (one compiled shape; the last batch wraps to the start
    and the wrapped rows are discarded). With dropless dispatch a token's loss does not
    depend on the other rows of its batch."""
    sources = read_meta(data_dir)["sources"]
    rows = {s: val_windows(data_dir, s, seq_len) for s in sources}
    rows = {s: r for s, r in rows.items() if len(r)}
    table = tokenizer_bytes(data_dir)
    n_bytes = None if table is None else {s: int(table[r[:, 1:]].sum()) for s, r in rows.items()}
    token_nll = token_nll_fn(dtype)

    def evaluate(model) -> dict[str, float]:
        nll, tokens = {}, {}
        for source, source_rows in rows.items():
            n, total = len(source_rows), 0.0
            for start in range(0, n, ROWS):
                batch = source_rows[np.arange(start, start + ROWS) % n]
                kept = np.asarray(token_nll(model, batch))[: n - start]
                total += float(kept.sum(dtype=np.float64))
            nll[source], tokens[source] = total, source_rows[:, 1:].size
        return domain_metrics(nll, tokens, n_bytes)

    return evaluate
