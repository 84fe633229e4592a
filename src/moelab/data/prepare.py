"""prepare: files -> documents -> deduplicated splits -> tokenizer -> token shards.

Everything that can fail on the user's input (globs, decoding, filters, tokenizer
settings) runs in memory first; only then is the output directory touched, meta.json
last. So a failed or interrupted prepare never leaves a directory that looks complete.
"""

from __future__ import annotations

import sysconfig
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from moelab.data.dedup import MAX_THRESHOLD, drop_exact_duplicates, drop_near_duplicates
from moelab.data.ingest import (
    Document,
    list_documents,
    map_documents,
    process_document,
    source_globs,
)
from moelab.data.loader import META_FILE, SPLITS
from moelab.data.provenance import MANIFEST_FILE, count_documents, manifest_text, reason_kind
from moelab.data.shards import (
    pack,
    remove_stale_temporaries,
    shard_path,
    write_array,
    write_json,
    write_text,
)
from moelab.data.tokenizer import EOS, MIN_VOCAB, TOKENIZER_FILE, train_tokenizer
from moelab.errors import UserError

_STDLIB = sysconfig.get_paths()["stdlib"]
# Real text nobody here wrote, on every Debian machine with Python: the standard
# library's sources (code) and the packages' docs and man pages (English prose).
DEFAULT_SOURCES: dict[str, list[str]] = {
    "code": [f"{_STDLIB}/**/*.py", "!*/site-packages/*", "!*/dist-packages/*",
             "!*/test/*", "!*/tests/*", "!*/idle_test/*"],
    "prose": ["/usr/share/doc/*/README*", "/usr/share/doc/*/NEWS*",
              "/usr/share/doc/*/changelog*", "/usr/share/doc/*/copyright",
              "/usr/share/man/man[1-8]/*", "!*.html"],
}
# Caps that keep ensure_default_corpus near 15 s on two cores (`moelab train` with no
# arguments calls it): about 2.5M tokens, plenty for the small models of the lab.
DEFAULT_MAX_DOCS = 400
DEFAULT_MAX_CHARS = 100_000  # a few multi-megabyte changelogs would dominate the prose


def prepare(
    out_dir: str | Path,
    sources: dict[str, str | list[str]] | None = None,
    vocab_size: int = 4096,
    near_dup_threshold: float = 0.8,
    val_fraction: float = 0.05,
    min_chars: int = 200,
    max_docs_per_source: int | None = None,
    workers: int | None = None,
    use_ray: bool = False,
    max_chars: int | None = None,
) -> dict:
    """Build a dataset in out_dir and return meta.json's contents plus "seconds" per phase.

    sources: {name: glob or globs, '!glob' excluding}; None = the default corpus.
    Documents outside [min_chars, max_chars] after normalization are dropped, as are
    those with MinHash Jaccard >= near_dup_threshold to an earlier one; about
    val_fraction of each source's documents are held out; workers / use_ray choose
    how documents are mapped (None = one process per CPU).
    """
    _check_settings(vocab_size, near_dup_threshold, val_fraction, min_chars)
    globs = source_globs(DEFAULT_SOURCES if sources is None else sources)
    seconds: dict[str, float] = {}
    with _timed(seconds, "ingest"):
        process = partial(process_document, min_chars=min_chars, max_chars=max_chars)
        docs = map_documents(process, list_documents(globs, max_docs_per_source),
                             workers, use_ray)
    with _timed(seconds, "dedup"):
        drop_exact_duplicates(docs)
        drop_near_duplicates(docs, near_dup_threshold)
    _require_kept(docs, list(globs))
    assign_splits(docs, val_fraction)
    with _timed(seconds, "train_tokenizer"):
        tokenizer = train_tokenizer((d.text for d in docs if d.split == "train"), vocab_size)
    with _timed(seconds, "tokenize"):
        streams = _pack_streams(tokenizer, docs, list(globs))
    settings = dict(sources=globs, vocab_size=vocab_size, near_dup_threshold=near_dup_threshold,
                    val_fraction=val_fraction, min_chars=min_chars, max_chars=max_chars,
                    max_docs_per_source=max_docs_per_source)
    meta = _meta(tokenizer, streams, docs, settings)
    with _timed(seconds, "write"):
        write_dataset(Path(out_dir), tokenizer, streams, docs, meta)
    return {**meta, "seconds": seconds}


def ensure_default_corpus(path: str | Path) -> Path:
    """Prepare the built-in two-source corpus at path unless a complete one is there."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        prepare(path, DEFAULT_SOURCES, max_docs_per_source=DEFAULT_MAX_DOCS,
                max_chars=DEFAULT_MAX_CHARS)
    return path


def assign_splits(docs: list[Document], val_fraction: float) -> None:
    """Hold out about val_fraction of each source's kept documents, chosen by content
    hash: reproducible, and a document's split does not change as files are added.
    A source with two or more documents gets at least one in each split."""
    for source in dict.fromkeys(d.source for d in docs):
        ranked = sorted((d for d in docs if d.kept and d.source == source),
                        key=lambda d: d.sha256)
        n_val = sum(int(d.sha256[:8], 16) < val_fraction * 16**8 for d in ranked)
        n_val = min(max(n_val, 1), len(ranked) - 1)
        for i, doc in enumerate(ranked):
            doc.split = "val" if i < n_val else "train"


def write_dataset(
    out: Path,
    tokenizer: Tokenizer,
    streams: dict[tuple[str, str], np.ndarray],
    docs: list[Document],
    meta: dict,
) -> None:
    """Write every file under a temporary name, then rename; meta.json goes last."""
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # incomplete until the new meta lands
    remove_stale_temporaries(out)
    write_text(out / TOKENIZER_FILE, tokenizer.to_str())
    for (source, split), stream in streams.items():
        write_array(shard_path(out, source, split), stream)
    write_text(out / MANIFEST_FILE, manifest_text(docs))
    write_json(out / META_FILE, meta)


def _check_settings(vocab_size: int, threshold: float, val_fraction: float,
                    min_chars: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise UserError(f"vocab size {vocab_size} must be >= {MIN_VOCAB} (256 bytes + EOS)")
    if not 0 < threshold <= MAX_THRESHOLD:
        raise UserError(f"near-dup threshold {threshold} must be in (0, {MAX_THRESHOLD}]")
    if not 0 <= val_fraction < 1:
        raise UserError(f"val fraction {val_fraction} must be in [0, 1)")
    if min_chars < 1:
        raise UserError(f"min chars {min_chars} must be >= 1")


def _require_kept(docs: list[Document], sources: list[str]) -> None:
    """A source whose every document was filtered out cannot be trained on: say why."""
    for source in sources:
        mine = [d for d in docs if d.source == source]
        if not any(d.kept for d in mine):
            reasons = Counter(reason_kind(d.reason) for d in mine)
            raise UserError(
                f"source {source!r}: none of its {len(mine)} files survived filtering "
                f"({dict(reasons)}); add files, or lower --min-chars / raise "
                "--near-dup-threshold"
            )


def _pack_streams(
    tokenizer: Tokenizer, docs: list[Document], sources: list[str]
) -> dict[tuple[str, str], np.ndarray]:
    eos_id = tokenizer.token_to_id(EOS)
    streams = {}
    for source in sources:
        for split in SPLITS:
            mine = [d for d in docs if d.source == source and d.split == split]
            streams[source, split] = pack(tokenizer, mine, eos_id, f"tokenize {source}/{split}")
    return streams


def _meta(tokenizer: Tokenizer, streams: dict[tuple[str, str], np.ndarray],
          docs: list[Document], settings: dict) -> dict:
    sources = list(settings["sources"])
    counts = count_documents(d.manifest_record() for d in docs)
    return {
        "format": 1,
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": tokenizer.token_to_id(EOS),
        "eos_token": EOS,
        "dtype": str(streams[sources[0], "train"].dtype),
        "sources": sources,
        **{f"{split}_tokens": {s: len(streams[s, split]) for s in sources} for split in SPLITS},
        "documents": {s: dict(counts[s]) for s in sources},
        "settings": settings,
    }


@contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    seconds[phase] = round(time.perf_counter() - start, 3)
