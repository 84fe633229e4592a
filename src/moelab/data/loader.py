"""Loader: fixed-length windows of the packed shards, mixed over sources (or curated
cells, `moelab data curate`) by weight, optionally under a cap on epochs per component.

Each source's split is one token stream (documents joined by EOS); window k of it is
tokens[k*S : k*S + S + 1], so the inputs (row[:-1]) and targets (row[1:]) of a row
come from one slice. A batch is a pure function of (seed, step): a generator seeded
with both picks, for each row, a source with probability equal to its weight and then
a window of that source uniformly (with replacement). Resuming therefore needs only
the step, and the state saved with a checkpoint is a small dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data.cells import CELL_PREFIX, CELLS_DIR, cell_file_stem
from moelab.data.shards import shard_path
from moelab.errors import UserError

META_FILE = "meta.json"  # written last by prepare: its presence marks a complete dataset
SPLITS = ("train", "val")
VAL_SEED = 20240601  # val windows ignore the run's seed: every run is scored on the same text


def read_meta(data_dir: str | Path) -> dict:
    """The dataset's meta.json: vocab_size, eos_id, sources, train/val_tokens per source."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise UserError(
            f"{data_dir} is not a prepared dataset (no {META_FILE}; an interrupted prepare "
            f"leaves none); run `moelab data prepare --out {data_dir}`"
        )
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Mixture:
    """A resolved mixture: its components (source names, or "cell:<domain>/<bucket>"),
    their sampling weights, the tokens of each one's stream in the split, and, when a run
    length is known, the epochs each component's train tokens will be seen."""

    names: list[str]
    weights: np.ndarray  # [n] probabilities
    tokens: list[int]  # tokens of each component's stream in the split
    epochs: list[float] | None = None  # expected passes over each train stream in the run

    def report(self) -> str:
        """One line: every component's weight (and epochs, when known)."""
        epochs = self.epochs or [None] * len(self.names)
        return ", ".join(f"{n} {w:.3f}" + ("" if e is None else f" ({e:.2f} epochs)")
                         for n, w, e in zip(self.names, self.weights, epochs, strict=True))


def cells_of(meta: dict) -> dict[str, dict]:
    """{cell name: provenance} of a curated dataset (`moelab data curate`); {} if none."""
    return meta.get("cells", {}).get("cells", {})


def stream_path(data_dir: str | Path, name: str, split: str) -> Path:
    """A mixture component's token stream: a source's, or a cell's under cells/."""
    if name.startswith(CELL_PREFIX):
        stem = cell_file_stem(name.removeprefix(CELL_PREFIX))
        return Path(data_dir) / CELLS_DIR / f"{stem}.{split}.npy"
    return shard_path(data_dir, name, split)


def resolve_mixture(meta: dict, split: str, mixture: dict[str, float],
                    max_epochs: float | None = None, run_tokens: int | None = None) -> Mixture:
    """The one place a `data.mixture` becomes weights (stages of a run call it per stage).

    {} means the sources, proportional to their tokens. Otherwise the mixture names either
    sources or cells ("cell:d03/q4", from `moelab data curate`), not both: a document is in
    one source and one cell, so a mix of both would count it twice. With max_epochs and the
    run's train tokens, no component is drawn more than max_epochs times over on average:
    a weight above max_epochs * tokens / run_tokens is cut to it and the excess goes to the
    other components in proportion to their weights (water-filling, repeated until none is
    over); if even all at their caps cannot fill the run, that is an error."""
    cells = cells_of(meta)
    named_cells = [n for n in mixture if n.startswith(CELL_PREFIX)]
    if named_cells and len(named_cells) != len(mixture):
        raise UserError("data.mixture names both sources and cells; a document is in one of "
                        "each, so use only sources or only cell:<domain>/<bucket> names")
    if named_cells:
        available = [CELL_PREFIX + c for c in cells]
        unknown = sorted(set(named_cells) - set(available))
        if unknown:
            hint = (f"available cells: {available}" if cells else
                    "the dataset has no cells; run `moelab data curate DIR` first")
            raise UserError(f"data.mixture names cell(s) {unknown} that the dataset does not "
                            f"have; {hint}")
        names = available
        tokens = [cells[n.removeprefix(CELL_PREFIX)][f"{split}_tokens"] for n in names]
        train = [cells[n.removeprefix(CELL_PREFIX)]["train_tokens"] for n in names]
    else:
        names = list(meta["sources"])
        unknown = sorted(set(mixture) - set(names))
        if unknown:
            raise UserError(
                f"data.mixture names source(s) {unknown} that the dataset does not have; "
                f"available sources: {names}"
            )
        tokens = [meta[f"{split}_tokens"][s] for s in names]
        train = [meta["train_tokens"][s] for s in names]
    by_size = meta[f"{split}_tokens"]
    weights = np.array([mixture.get(n, 0.0) if mixture else by_size[n] for n in names], float)
    if (weights < 0).any() or weights.sum() <= 0:
        raise UserError(f"data.mixture weights must be >= 0 and not all 0, got {mixture}")
    weights = weights / weights.sum()
    if not (max_epochs and run_tokens):
        return Mixture(names, weights, tokens)
    weights = capped(weights, max_epochs * np.array(train, float) / run_tokens, mixture)
    epochs = (weights * run_tokens / np.maximum(train, 1)).tolist()
    return Mixture(names, weights, tokens, epochs)


def capped(weights: np.ndarray, caps: np.ndarray, mixture: dict) -> np.ndarray:
    """weights moved under caps (water-filling): capped components fixed at their cap, the
    rest rescaled to fill the remainder, until none exceeds its cap."""
    if caps[weights > 0].sum() < 1 - 1e-12:
        raise UserError(
            f"data.max_epochs: the mixture's components hold too few train tokens for the run "
            f"even at the cap ({caps[weights > 0].sum():.3f} of the run's tokens); raise "
            f"data.max_epochs, train fewer steps or add components to data.mixture {mixture}")
    weights = weights.copy()
    fixed = np.zeros(len(weights), bool)
    while (over := (weights > caps + 1e-15) & ~fixed).any():
        fixed |= over
        weights[fixed] = caps[fixed]
        free = ~fixed & (weights > 0)
        weights[free] *= (1 - weights[fixed].sum()) / weights[free].sum()
    return weights


def mixture_weights(meta: dict, split: str, mixture: dict[str, float]) -> np.ndarray:
    """Probabilities over resolve_mixture's components; {} means proportional to tokens."""
    return resolve_mixture(meta, split, mixture).weights


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
        max_epochs: float | None = None,
        run_tokens: int | None = None,
    ) -> None:
        if split not in SPLITS:
            raise UserError(f"split must be one of {SPLITS}, got {split!r}")
        self.meta = read_meta(data_dir)
        self.sources: list[str] = list(self.meta["sources"])  # the dataset's, for evals
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.mixture = resolve_mixture(self.meta, split, mixture or {}, max_epochs, run_tokens)
        self.components, self.weights = self.mixture.names, self.mixture.weights
        self.streams = [np.load(stream_path(data_dir, s, split), mmap_mode="r")
                        for s in self.components]
        self.windows = np.array([max(0, (len(t) - 1) // seq_len) for t in self.streams])
        too_short = [s for s, w, n in zip(self.components, self.weights, self.windows,
                                          strict=True) if w > 0 and n == 0]
        if too_short:
            used = [s for s, w in zip(self.components, self.weights, strict=True) if w > 0]
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
        source = rng.choice(len(self.components), size=self.batch_size, p=self.weights)
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
        weights = dict(zip(self.components, self.weights.tolist(), strict=True))
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
