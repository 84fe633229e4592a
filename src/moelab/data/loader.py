"""Loader: fixed-length windows of the packed shards, mixed over sources by weight.

Each source's split is one token stream (documents joined by EOS); window k of it is
tokens[k*S : k*S + S + 1], so the inputs (row[:-1]) and targets (row[1:]) of a row
come from one slice. A batch is a pure function of (seed, step): a generator seeded
with both picks, for each row, a source with probability equal to its weight and then
a window of that source uniformly (with replacement). Resuming therefore needs only
the step, and the state saved with a checkpoint is a small dict.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moelab.data.shards import shard_path
from moelab.errors import UserError
from moelab.schema import MapOf, SchemaError, brief, load_tokens, read_json

META_FILE = "meta.json"  # written last by prepare: its presence marks a complete dataset
SPLITS = ("train", "val")
# What the loader (and trainer, ladder, stats) read from meta.json.
META_SPEC = {"vocab_size": int, "eos_id": int, "sources": [str],
             "train_tokens": MapOf(int), "val_tokens": MapOf(int)}
VAL_SEED = 20240601  # val windows ignore the run's seed: every run is scored on the same text


def read_meta(data_dir: str | Path) -> dict:
    """The dataset's meta.json: vocab_size, eos_id, sources, train/val_tokens per source."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise UserError(
            f"{data_dir} is not a prepared dataset (no {META_FILE}; an interrupted prepare "
            f"leaves none); run `moelab data prepare --out {data_dir}`"
        )
    meta = read_json(path, META_SPEC)
    for split in SPLITS:
        missing = sorted(set(meta["sources"]) - set(meta[f"{split}_tokens"]))
        if missing:
            raise SchemaError(path, f"{split}_tokens lacks source(s) {brief(missing)}; "
                                    "re-prepare the dataset")
    if not 0 <= meta["eos_id"] < meta["vocab_size"]:
        raise SchemaError(path, f"eos_id {meta['eos_id']} is outside the vocabulary of "
                                f"{meta['vocab_size']}; re-prepare the dataset")
    return meta


def mixture_weights(meta: dict, split: str, mixture: dict[str, float]) -> np.ndarray:
    """Probabilities [n_sources] in meta's source order; {} means proportional to tokens."""
    sources = meta["sources"]
    unknown = sorted(set(mixture) - set(sources))
    if unknown:
        raise UserError(
            f"data.mixture names source(s) {unknown} that the dataset does not have; "
            f"available sources: {sources}"
        )
    by_size = meta[f"{split}_tokens"]
    weights = np.array([mixture.get(s, 0.0) if mixture else by_size[s] for s in sources], float)
    if (weights < 0).any() or weights.sum() <= 0:
        raise UserError(f"data.mixture weights must be >= 0 and not all 0, got {mixture}")
    return weights / weights.sum()


class Loader:
    """Batches int32 [B, S+1] of one split; `next(loader)` walks steps, `batch(step)` jumps."""

    def __init__(
        self,
        data_dir: str | Path,
        split: str = "train",
        seq_len: int = 128,
        batch_size: int = 8,
        mixture: dict[str, float] | None = None,
        seed: int = 0,
    ) -> None:
        if split not in SPLITS:
            raise UserError(f"split must be one of {SPLITS}, got {split!r}")
        self.meta = read_meta(data_dir)
        self.sources: list[str] = list(self.meta["sources"])
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.weights = mixture_weights(self.meta, split, mixture or {})
        self.streams = [load_tokens(shard_path(data_dir, s, split), f"{split} stream of {s}")
                        for s in self.sources]
        vocab = self.meta["vocab_size"]
        for source, stream in zip(self.sources, self.streams, strict=True):
            # the extremes of a memory map are a pass over it: once per start, not per batch
            if len(stream) and not 0 <= int(stream.min()) <= int(stream.max()) < vocab:
                raise SchemaError(shard_path(data_dir, source, split),
                                  f"holds token ids outside [0, {vocab}); re-prepare the dataset")
        self.windows = np.array([max(0, (len(t) - 1) // seq_len) for t in self.streams])
        too_short = [s for s, w, n in zip(self.sources, self.weights, self.windows, strict=True)
                     if w > 0 and n == 0]
        if too_short:
            used = [s for s, w in zip(self.sources, self.weights, strict=True) if w > 0]
            # Zero weights cannot help when every source in use is too short (one source).
            other = ("re-prepare with a larger --val-fraction or more documents" if
                     split == "val" else "re-prepare with more documents")
            fix = other if set(too_short) == set(used) else "give them weight 0 in data.mixture"
            raise UserError(
                f"the {split} split of source(s) {too_short} has fewer than seq_len + 1 = "
                f"{seq_len + 1} tokens; lower data.seq_len or {fix}"
            )
        self.step = 0

    def plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index [B], window index [B]) of each row of the batch at `step`."""
        rng = np.random.default_rng([self.seed if self.split == "train" else VAL_SEED, step])
        source = rng.choice(len(self.sources), size=self.batch_size, p=self.weights)
        return source, rng.integers(0, self.windows[source])

    def batch(self, step: int) -> np.ndarray:
        """int32 [B, S+1]: inputs are [:, :-1], targets [:, 1:]."""
        s, (sources, windows) = self.seq_len, self.plan(step)
        rows = [self.streams[i][k * s : k * s + s + 1]
                for i, k in zip(sources, windows, strict=True)]
        return np.stack(rows).astype(np.int32)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        """JSON-able; with the same dataset and settings, the step is all resuming needs."""
        weights = dict(zip(self.sources, self.weights.tolist(), strict=True))
        return {"step": self.step, "seed": self.seed, "split": self.split,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "weights": weights}

    def load_state_dict(self, state: dict) -> None:
        """Resume at state["step"]; refuses a state saved under other settings, whose
        batches would silently differ from the uninterrupted run's."""
        mine = self.state_dict()
        changed = sorted(k for k in mine if k != "step" and state.get(k) != mine[k])
        if changed:
            details = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise UserError(f"loader state does not match this loader ({details}); "
                            "resume with the data config the run started with")
        self.step = int(state["step"])
