"""Long-context probes: did a context extension work, and what did it cost at short range?

Three measurements on held-out (val split) text, all with dropless routing so a token's
score never depends on what else is in the batch:

1. Loss by position bucket (0-128, 128-256, ...) over the first `length` tokens of every
   held-out document at least that long: a model that cannot use (or is confused by)
   positions past its training length shows it as loss rising in the late buckets.
2. Passkey: a sentence "The pass key is NNNNN. Remember it." inserted at a controlled depth
   of held-out filler text, and "What is the pass key? The pass key is" at the end. Scored
   by the log-probability of the key's tokens (continuous, so it moves even for a model far
   too small to retrieve exactly), by that log-probability minus the one the same model
   gives the key when a *different* key was inserted in the same text (paired, so the
   filler's and the key's own difficulty cancel: the part that comes from reading the
   context, ~0 for a model that ignores it, with its standard error), and by exact greedy
   retrieval (argmax at every key token, which is what greedy decoding produces; chance is
   ~0 for a 5-digit key).
3. Short-context loss: mean CE over every non-overlapping window of the original length
   in each source's val split (the ladder's whole-split score), to compare before/after.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from moelab.errors import UserError

BUCKET = 128  # tokens per position bucket
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where in the filler the key sentence goes
MULTIPLES = (1, 2, 4, 8)  # passkey lengths, in multiples of the original context
TRIALS = 16  # key pairs per (length, depth): the paired gain's se ~ sd / 4
ROWS = 4  # sequences per forward pass
RESULTS_FILE = "longctx.json"
LENGTH_EDGES = (128, 256, 512, 1024, 2048, 4096, 8192)


def documents(stream: np.ndarray, eos: int) -> list[np.ndarray]:
    """The documents of a packed stream (each followed by EOS), without their EOS."""
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [np.asarray(stream[a:e]) for a, e in zip(starts, ends, strict=True)]


def held_out(data_dir: str | Path) -> dict[str, list[np.ndarray]]:
    """Every source's val-split documents."""
    from moelab.data.loader import read_meta
    from moelab.data.shards import shard_path
    from moelab.data.tokenizer import EOS, load_tokenizer

    eos = load_tokenizer(data_dir).token_to_id(EOS)
    return {s: documents(np.load(shard_path(data_dir, s, "val"), mmap_mode="r"), eos)
            for s in read_meta(data_dir)["sources"]}


def length_counts(docs: dict[str, list[np.ndarray]]) -> dict[str, dict[str, int]]:
    """How many held-out documents of each source have at least N tokens."""
    return {s: {f">={n}": sum(len(d) >= n for d in ds) for n in LENGTH_EDGES}
            for s, ds in docs.items()}


@functools.cache
def _token_losses():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    @eqx.filter_jit
    def token_losses(model, batch):
        """[B, S+1] tokens -> (CE [B, S] of each next token, argmax == target [B, S])."""
        logits = model(batch[:, :-1])[0].astype(jnp.float32)
        target = batch[:, 1:]
        picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked, jnp.argmax(logits, -1) == target

    return token_losses


def _score(model, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token CE and argmax-hit of rows [N, S+1], ROWS at a time (one compiled shape)."""
    losses, hits, n = [], [], len(rows)
    for start in range(0, n, ROWS):
        batch = rows[np.arange(start, start + ROWS) % n]  # the last batch wraps around
        loss, hit = _token_losses()(model, batch.astype(np.int32))
        losses.append(np.asarray(loss)[: n - start])
        hits.append(np.asarray(hit)[: n - start])
    return np.concatenate(losses), np.concatenate(hits)


def loss_by_position(model, docs: list[np.ndarray], length: int,
                     bucket: int = BUCKET) -> dict[str, Any]:
    """Mean CE per position bucket over the first length+1 tokens of each document that has
    them (the document's own start is position 0)."""
    rows = [d[: length + 1] for d in docs if len(d) >= length + 1]
    if not rows:
        return {"length": length, "documents": 0, "buckets": []}
    losses, _ = _score(model, np.stack(rows))
    buckets = [{"start": a, "end": min(a + bucket, length),
                "loss": float(losses[:, a:a + bucket].mean())} for a in range(0, length, bucket)]
    return {"length": length, "documents": len(rows), "buckets": buckets}


def passkey_row(fill: np.ndarray, needle: np.ndarray, query: np.ndarray,
                depth: float) -> np.ndarray:
    """fill with the needle inserted after round(depth * len(fill)) of its tokens, then the
    query (which ends with the key's tokens: the targets that are scored)."""
    at = int(round(depth * len(fill)))
    return np.concatenate([fill[:at], needle, fill[at:], query])


def passkey(model, tokenizer, filler: np.ndarray, length: int, depths=DEPTHS,
            trials: int = TRIALS, seed: int = 0) -> list[dict[str, Any]]:
    """The passkey scores at one total length (in tokens), one entry per depth.

    Each trial is a pair of rows that differ only in the inserted key: the same filler,
    depth and query (which ends with the real key). The pair's difference in the real
    key's log-prob is the part that comes from reading the context; filler and key
    difficulty cancel in it, so `retrieval_gain` (the mean difference) carries its
    standard error `gain_se` (sd of the differences / sqrt(trials))."""
    enc = lambda text: np.asarray(tokenizer.encode(text).ids, np.int64)
    rng = np.random.default_rng(seed + length)
    out = []
    for depth in depths:
        rows, spans = [], []
        for _ in range(trials):
            key, other = rng.choice(90000, size=2, replace=False) + 10000
            key_ids, other_ids = enc(f" {key}"), enc(f" {other}")
            query = np.concatenate([enc(" What is the pass key? The pass key is"), key_ids])
            needles = [np.concatenate([enc(" The pass key is"), inserted, enc(". Remember it.")])
                       for inserted in (key_ids, other_ids)]
            # both rows are length + 1 tokens of the same filler from the same start (a
            # key one token shorter leaves room for one more filler token at the end)
            n_fill = [length + 1 - len(needle) - len(query) for needle in needles]
            if min(n_fill) < 1:
                raise UserError(f"passkey length {length} is too short for the key "
                                f"sentence and query ({len(needles[0]) + len(query)} tokens)")
            if max(n_fill) >= len(filler):
                raise UserError(f"passkey length {length} needs more filler than the "
                                f"{len(filler)} held-out tokens")
            start = int(rng.integers(0, len(filler) - max(n_fill)))
            for needle, n in zip(needles, n_fill, strict=True):  # the trial, then its control
                rows.append(passkey_row(filler[start:start + n], needle, query, depth))
            spans.append(len(key_ids))
        losses, hits = _score(model, np.stack(rows))
        lp, control, exact = [], [], []
        for i, n_key in enumerate(spans):  # the key's tokens are the last n_key targets
            lp.append(-losses[2 * i, -n_key:].sum())
            control.append(-losses[2 * i + 1, -n_key:].sum())
            exact.append(bool(hits[2 * i, -n_key:].all()))
        gains = np.asarray(lp) - np.asarray(control)
        out.append({"depth": depth, "key_logprob": float(np.mean(lp)),
                    "control_logprob": float(np.mean(control)),
                    "retrieval_gain": float(gains.mean()),
                    "gain_se": float(gains.std(ddof=1) / np.sqrt(trials)) if trials > 1
                    else float("nan"),
                    "gains": [float(g) for g in gains],
                    "exact": float(np.mean(exact)), "trials": trials})
    return out


def pooled_gain(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean, standard error) of the paired retrieval gain over every trial of every depth
    of one length: the passkey score of a length, with its noise."""
    gains = np.concatenate([r["gains"] for r in rows])
    return float(gains.mean()), float(gains.std(ddof=1) / np.sqrt(len(gains)))


def short_context_loss(model, data_dir: str | Path, length: int) -> dict[str, float]:
    """Mean CE over every non-overlapping length-token window of each source's val split."""
    from moelab.eval.bpb import val_windows

    out = {}
    for source in held_out(data_dir):
        rows = val_windows(data_dir, source, length)
        if len(rows):
            out[source] = float(_score(model, rows)[0].mean())
    out["mean"] = float(np.mean(list(out.values())))
    return out


def evaluate(model, data_dir: str | Path, original: int, max_multiple: int = MULTIPLES[-1],
             trials: int = TRIALS, seed: int = 0) -> dict[str, Any]:
    """All three probes for a model whose original (pre-extension) context is `original`."""
    from moelab.data.tokenizer import load_tokenizer
    from moelab.model.transformer import with_dropless_dispatch

    model = with_dropless_dispatch(model)
    docs = held_out(data_dir)
    pooled = [d for ds in docs.values() for d in ds]
    filler = np.concatenate(pooled)
    tokenizer = load_tokenizer(data_dir)
    multiples = [m for m in MULTIPLES if m <= max_multiple]
    longest = original * multiples[-1]
    if longest + 1 >= len(filler):
        raise UserError(f"the longest probe ({original} x {multiples[-1]} = {longest} tokens) "
                        f"needs more held-out text than the {len(filler)} tokens in {data_dir}; "
                        f"lower --original or --max-multiple")
    return {
        "original_length": original,
        "documents_by_length": length_counts(docs),
        "loss_by_position": loss_by_position(model, pooled, longest),
        "passkey": {f"{m}x": passkey(model, tokenizer, filler, original * m, trials=trials,
                                     seed=seed) for m in multiples},
        "short_context_loss": short_context_loss(model, data_dir, original),
    }


def summary(result: dict[str, Any]) -> dict[str, float]:
    """Flat numbers for the lab: the late-bucket loss, passkey means per length, short loss."""
    out = {"longctx/short_loss": result["short_context_loss"]["mean"]}
    buckets = result["loss_by_position"]["buckets"]
    if buckets:
        out["longctx/loss_last_bucket"] = buckets[-1]["loss"]
        out["longctx/loss_all_positions"] = float(np.mean([b["loss"] for b in buckets]))
    for name, rows in result["passkey"].items():
        for metric in ("key_logprob", "exact"):
            out[f"longctx/passkey_{name}_{metric}"] = float(np.mean([r[metric] for r in rows]))
        gain, se = pooled_gain(rows)
        out[f"longctx/passkey_{name}_retrieval_gain"] = gain
        out[f"longctx/passkey_{name}_retrieval_gain_se"] = se
    return out


def original_length(cfg) -> int:
    """The context a run was pre-trained at: rope's original length, else seq_len / factor."""
    rope = cfg.model.rope
    return rope.original_max_position_embeddings or max(1, round(cfg.data.seq_len / rope.factor))


def run(run_dir: str | Path, original: int | None = None, max_multiple: int = 8,
        trials: int = TRIALS, out: str | Path | None = None) -> dict[str, Any]:
    """`moelab eval longctx RUN_DIR`: evaluate the run's newest good checkpoint, write the
    JSON beside it (or to `out`) and log the summary to the lab if the run is attached."""
    from moelab import outputs
    from moelab.config import data_dir
    from moelab.train.checkpoint import load_latest

    path = Path(out) if out else Path(run_dir) / RESULTS_FILE
    outputs.check_file(path, ours=out is None or _is_result(path))  # never a user's file
    model, cfg, step = load_latest(run_dir)
    original = original or original_length(cfg)
    if original <= 0 or max_multiple < 1 or trials < 1:
        raise UserError("--original, --max-multiple and --trials must be >= 1")
    result = {"run_dir": str(run_dir), "step": step,
              **evaluate(model, data_dir(cfg.data.path), original, max_multiple, trials)}
    path.write_text(json.dumps(result, indent=1) + "\n")
    _log_to_lab(Path(run_dir), step, summary(result))
    return result


def _is_result(path: Path) -> bool:
    """Whether `path` holds an earlier result of `run` (what a given --out may replace)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, not text, not JSON
        return False
    return isinstance(record, dict) and {"run_dir", "step", "original_length"} <= record.keys()


def _log_to_lab(run_dir: Path, step: int, numbers: dict[str, float]) -> None:
    """Mirror the summary into the lab store when the run is attached to an experiment."""
    from moelab.train.rundir import LAB_RUN_FILE

    marker = run_dir / LAB_RUN_FILE
    if not marker.exists():
        return
    from moelab.lab.store import Store, default_lab_path

    store = Store(default_lab_path())
    run_id = store.attached_run(marker)
    store.log_metrics(run_id, step, {k: v for k, v in numbers.items() if math.isfinite(v)})
    store.log_event(run_id, step, "longctx", f"long-context eval written to {RESULTS_FILE}")
