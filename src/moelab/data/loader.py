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

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data.cells import CELL_PREFIX, CELLS_DIR, cell_file_stem
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
    if Path(data_dir).is_file():  # a file: `prepare --out` it would be refused too
        raise UserError(f"{data_dir} is a file, not a prepared dataset (a directory that "
                        "`moelab data prepare --out DIR` writes)")
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


def restrict(meta: dict, unique_tokens: dict[str, int] | None) -> dict:
    """meta with each named source's train tokens cut to its first `unique_tokens[source]`
    (data.unique_tokens): what a run may read, so passes and data.max_epochs count against
    it. The full counts stay in "train_tokens_full", which a mixture of {} weighs by."""
    if not unique_tokens:
        return meta
    unknown = sorted(set(unique_tokens) - set(meta["sources"]))
    if unknown:
        raise UserError(f"data.unique_tokens names source(s) {unknown} that the dataset does "
                        f"not have; available sources: {meta['sources']}")
    full = meta["train_tokens"]
    over = {s: (n, full[s]) for s, n in unique_tokens.items() if n > full[s]}
    if over:
        s, (n, have) = next(iter(over.items()))
        raise UserError(f"data.unique_tokens: {s} asks for {n} train tokens but the dataset "
                        f"holds {have}; lower it or leave the source out")
    return {**meta, "train_tokens_full": dict(full),
            "train_tokens": {s: min(t, unique_tokens.get(s, t)) for s, t in full.items()}}


SUBSET_PIECE = 4096  # tokens per piece of a spread subset: 32 windows of 128, a few files


def unique_subset(stream: np.ndarray, k: int | None, how: str = "first") -> np.ndarray:
    """The `k` train tokens of `stream` a run with data.unique_tokens reads: its first k
    ("first"), or ("spread") k tokens in pieces of about SUBSET_PIECE, one at the start of
    each of ceil(k / SUBSET_PIECE) equal segments of the stream, so the subset spans the
    stream's files instead of its first few. `k` None or past the stream: all of it."""
    if k is None or k >= len(stream):
        return stream
    if how == "first":
        return stream[:k]
    pieces = -(-k // SUBSET_PIECE)
    sizes = np.diff(np.linspace(0, k, pieces + 1).round().astype(np.int64))
    starts = np.arange(pieces, dtype=np.int64) * len(stream) // pieces
    return np.concatenate([stream[a:a + n] for a, n in zip(starts, sizes, strict=True)])


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
    by_size = meta.get("train_tokens_full", meta["train_tokens"]) if split == "train" \
        else meta[f"{split}_tokens"]
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


def source_weights(meta: dict, mixture: dict[str, float]) -> dict[str, float]:
    """Each source's share of the train tokens a mixture draws: its weights when it names
    sources; for a mixture of cells, each cell's weight spread over the sources of its
    train tokens (meta.json's cells[...]["source_train_tokens"]). The val splits are per
    source, so a loss "weighted by the training mixture" weighs them by this."""
    mix = resolve_mixture(meta, "train", mixture)
    if not any(n.startswith(CELL_PREFIX) for n in mix.names):
        return dict(zip(mix.names, mix.weights.tolist(), strict=True))
    shares = dict.fromkeys(meta["sources"], 0.0)
    for name, weight in zip(mix.names, mix.weights.tolist(), strict=True):
        by_source = cells_of(meta)[name.removeprefix(CELL_PREFIX)].get("source_train_tokens")
        if by_source is None:
            raise UserError(f"meta.json's cell {name} has no source_train_tokens (curated by an "
                            "older moelab); re-run `moelab data curate` on the dataset")
        total = sum(by_source.values())
        for source, tokens in by_source.items():
            shares[source] += weight * tokens / total if total else 0.0
    norm = sum(shares.values())
    return {s: w / norm for s, w in shares.items()} if norm else shares


class Batches:
    """`next(loader)` walks steps, `batch(step)` jumps: each batch is rows [B, S+1] of
    windows (source i, window k) of S + 1 tokens, read from the token streams."""

    streams: list[np.ndarray]
    step: int

    def batch(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def rows(self, sources: np.ndarray, windows: np.ndarray, seq_len: int) -> np.ndarray:
        """int32 [B, S+1]: window k of source i is tokens[k*S : k*S + S + 1]."""
        s = seq_len
        rows = [self.streams[i][k * s : k * s + s + 1]
                for i, k in zip(sources, windows, strict=True)]
        return np.stack(rows).astype(np.int32)

    def state_dict(self) -> dict:
        raise NotImplementedError

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

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch(self.step)
        self.step += 1
        return batch


class Loader(Batches):
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
        unique_tokens: dict[str, int] | None = None,
        unique_sample: str = "first",
    ) -> None:
        if split not in SPLITS:
            raise UserError(f"split must be one of {SPLITS}, got {split!r}")
        self.meta = read_meta(data_dir)
        if split == "train":
            self.meta = restrict(self.meta, unique_tokens)
        self.sources: list[str] = list(self.meta["sources"])  # the dataset's, for evals
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.mixture = resolve_mixture(self.meta, split, mixture or {}, max_epochs, run_tokens)
        self.components, self.weights = self.mixture.names, self.mixture.weights
        self.streams = [load_tokens(stream_path(data_dir, s, split), f"{split} stream of {s}")
                        for s in self.components]
        if split == "train" and unique_tokens:  # each limited source's subset
            self.streams = [unique_subset(t, unique_tokens.get(s), unique_sample)
                            for s, t in zip(self.components, self.streams, strict=True)]
        vocab = self.meta["vocab_size"]
        for name, stream in zip(self.components, self.streams, strict=True):
            # the extremes of a memory map are a pass over it: once per start, not per batch
            if len(stream) and not 0 <= int(stream.min()) <= int(stream.max()) < vocab:
                raise SchemaError(stream_path(data_dir, name, split),
                                  f"holds token ids outside [0, {vocab}); re-prepare the dataset")
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
        return self.rows(*self.plan(step), self.seq_len)

    def state_dict(self) -> dict:
        """JSON-able; with the same dataset and settings, the step is all resuming needs."""
        weights = dict(zip(self.components, self.weights.tolist(), strict=True))
        return {"step": self.step, "seed": self.seed, "split": self.split,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "weights": weights}



def apportion(weights: np.ndarray, rows: int) -> np.ndarray:
    """Rows per source [n] summing exactly to `rows`: floor(w * rows) each, the rows left
    over to the largest remainders (Hamilton's method; ties to the earlier source), so every
    count is within one row of w * rows."""
    exact = weights * rows
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: rows - int(counts.sum())]] += 1
    return counts


class StagedLoader(Batches):
    """The train batches of a staged run (`config/plan.py`): each stage's rows are drawn
    exactly as its plan says, and each source is read without replacement across stages.

    A stage of R rows (steps x its batch size) gets `apportion(weights, R)` rows of each
    source, shuffled by (seed, stage); so the tokens of each source in each stage equal the
    plan exactly, not in expectation. Each source's windows (of the stage's seq_len) are
    read in a seeded permutation, one epoch after another, with one cursor per source and
    seq_len that carries on across stages: no window is repeated before the source's epoch
    is used up and none is skipped. (A stage with a new seq_len reads its own grid of
    windows, so its text may overlap what an earlier seq_len read.) Everything is a pure
    function of (seed, plan, step), so resuming needs only the step.
    """

    def __init__(self, data_dir: str | Path, stages: tuple, seed: int = 0,
                 unique_tokens: dict[str, int] | None = None,
                 unique_sample: str = "first") -> None:
        self.meta = restrict(read_meta(data_dir), unique_tokens)
        self.sources: list[str] = list(self.meta["sources"])
        self.stages, self.seed, self.step = tuple(stages), seed, 0
        limit = unique_tokens or {}
        self.streams = [unique_subset(np.load(shard_path(data_dir, s, "train"), mmap_mode="r"),
                                      limit.get(s), unique_sample) for s in self.sources]
        self.weights = [mixture_weights(self.meta, "train", st.mixture) for st in self.stages]
        self.counts = [apportion(w, st.rows) for w, st in zip(self.weights, self.stages,
                                                              strict=True)]
        self._before: list[np.ndarray] = []  # per stage: rows each source read before it
        seen: dict[int, np.ndarray] = {}
        for st, counts in zip(self.stages, self.counts, strict=True):
            prior = seen.setdefault(st.seq_len, np.zeros(len(self.sources), np.int64))
            self._before.append(prior.copy())
            prior += counts
            short = [s for s, c in zip(self.sources, counts, strict=True)
                     if c and self.windows(s, st.seq_len) == 0]
            if short:
                raise UserError(f"stage {st.index}: source(s) {short} have fewer than seq_len "
                                f"+ 1 = {st.seq_len + 1} train tokens; give them weight 0 there")
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[tuple[int, int, int], np.ndarray] = {}

    def windows(self, source: str, seq_len: int) -> int:
        return max(0, (len(self.streams[self.sources.index(source)]) - 1) // seq_len)

    def stage_at(self, step: int):
        return next(st for st in reversed(self.stages) if step >= st.start)

    def _stage_rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(source [R], that source's cursor [R]) of every row of stage k, in order."""
        if k not in self._rows:
            rng = np.random.default_rng([self.seed, k, 1])
            source = rng.permutation(np.repeat(np.arange(len(self.sources)), self.counts[k]))
            rank = np.empty_like(source)
            for i in range(len(self.sources)):
                at = np.flatnonzero(source == i)
                rank[at] = np.arange(len(at))
            self._rows[k] = source, rank + self._before[k][source]
        return self._rows[k]

    def _window(self, source: int, seq_len: int, cursor: int) -> int:
        n = self.windows(self.sources[source], seq_len)
        key = (source, seq_len, cursor // n)  # one permutation per epoch of the source
        if key not in self._perms:
            self._perms[key] = np.random.default_rng([self.seed, *key, 2]).permutation(n)
        return int(self._perms[key][cursor % n])

    def plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index [B], window index [B]) of each row at `step`, B = the stage's."""
        st = self.stage_at(step)
        source, cursor = self._stage_rows(st.index)
        rows = slice((step - st.start) * st.batch_size, (step - st.start + 1) * st.batch_size)
        windows = [self._window(i, st.seq_len, c) for i, c in zip(source[rows], cursor[rows],
                                                                   strict=True)]
        return source[rows], np.array(windows, np.int64)

    def batch(self, step: int) -> np.ndarray:
        """int32 [B, S+1] of the stage that trains `step`."""
        return self.rows(*self.plan(step), self.stage_at(step).seq_len)

    def state_dict(self) -> dict:
        """The step, the seed and each stage's data plan (the trainer compares plans)."""
        return {"step": self.step, "seed": self.seed, "stages": [
            {"start": st.start, "end": st.end, "seq_len": st.seq_len,
             "batch_size": st.batch_size, "rows": dict(zip(self.sources, c.tolist(),
                                                           strict=True))}
            for st, c in zip(self.stages, self.counts, strict=True)]}

    def load_state_dict(self, state: dict) -> None:
        """Resume at state["step"]; refuses a state whose started stages read other rows."""
        step, mine = int(state["step"]), self.state_dict()
        started = [i for i, st in enumerate(mine["stages"]) if st["start"] < step]
        saved = state.get("stages", [])
        if state.get("seed") != self.seed or any(
                i >= len(saved) or saved[i] != mine["stages"][i] for i in started):
            raise UserError("loader state does not match this plan's stages that have started "
                            "(their rows would differ from the saved run's); resume with the "
                            "plan the run trained with")
        self.step = step


class ConversationLoader(Batches):
    """Train batches of conversations (`data.conversations`): the file's conversations,
    encoded with the dataset's tokenizer and chat template, packed into rows of
    seq_len + 1 (`chat.pack`), and drawn epoch by epoch in a permutation seeded by
    (seed, epoch). A batch is the dict `chat.Packed.batch` (tokens, segments, positions,
    loss mask), a pure function of (seed, step) like every loader's."""

    def __init__(self, data_dir: str | Path, path: str | Path, seq_len: int, batch_size: int,
                 seed: int = 0) -> None:
        from moelab.data.chat import (
            chat_template_of,
            encode_all,
            pack,
            read_conversations,
            require_chat_tokens,
        )
        from moelab.data.tokenizer import load_tokenizer

        self.meta = read_meta(data_dir)
        self.sources: list[str] = list(self.meta["sources"])  # the corpus's, for its val
        self.path, self.seq_len, self.batch_size, self.seed = str(path), seq_len, batch_size, seed
        tokenizer = load_tokenizer(data_dir)
        require_chat_tokens(tokenizer, data_dir)
        template = chat_template_of(data_dir)
        self.conversations = read_conversations(path)
        self.rows = pack(encode_all(tokenizer, self.conversations, seq_len, template), seq_len,
                         self.meta["eos_id"])
        self.step = 0

    def plan(self, step: int) -> np.ndarray:
        """The packed rows of the batch at `step`: positions step*B.. of the concatenated
        per-epoch permutations of the rows."""
        n = len(self.rows)
        at = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs = {int(e): np.random.default_rng([self.seed, int(e)]).permutation(n)
                  for e in np.unique(at // n)}
        return np.array([epochs[int(i // n)][i % n] for i in at])

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows.batch(self.plan(step))

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "conversations": self.path,
                "rows": len(self.rows), "seq_len": self.seq_len, "batch_size": self.batch_size}
