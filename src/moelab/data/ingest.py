"""Ingest: find each source's files, then read, decode, normalize and sign every one.

`process_document` is the per-document work. It is pure (its result depends only on
its arguments and the file's bytes), so `map_documents` can run it serially, on a local
process pool, or with Ray Data across machines, and get the same documents back.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import gzip
import hashlib
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
from tqdm import tqdm

from moelab.data.dedup import signature
from moelab.data.text import decode, is_man_page, normalize, strip_roff
from moelab.errors import UserError

_SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")  # names become shard file names
POOL_MIN_DOCS = 64  # below this, starting worker processes costs more than it saves


@dataclass
class Document:
    """One file of one source, and what the pipeline decided about it."""

    source: str
    path: str
    sha256: str = ""  # of the normalized text; of the raw bytes when it is not text
    status: str = "kept"  # "kept" or "dropped"
    reason: str = ""  # why dropped (too_short, near_dup_of:PATH, ...) or a note if kept
    text: str = ""
    signature: np.ndarray | None = None  # MinHash values, for near-duplicate search
    split: str = ""  # "train" or "val", once kept documents are split
    tokens: int = 0  # tokens in the shard, EOS included

    @property
    def kept(self) -> bool:
        return self.status == "kept"

    def drop(self, reason: str) -> None:
        """Mark dropped and let go of the text: only the manifest needs this document now."""
        self.status, self.reason, self.text, self.signature = "dropped", reason, "", None

    def manifest_record(self) -> dict:
        fields = ("source", "path", "sha256", "status", "reason", "split", "tokens")
        return {name: getattr(self, name) for name in fields}


def source_globs(sources: dict[str, str | list[str]]) -> dict[str, list[str]]:
    """Check source names and give every source a list of patterns."""
    if not sources:
        raise UserError("no sources given; pass --source NAME=GLOB (e.g. code='src/**/*.py')")
    for name in sources:
        if not _SOURCE_NAME.fullmatch(name):
            raise UserError(f"source name {name!r} must be letters, digits, '_' or '-'")
    return {name: [p] if isinstance(p, str) else list(p) for name, p in sources.items()}


def find_files(patterns: list[str]) -> list[str]:
    """Sorted files matching the patterns; a pattern starting with '!' excludes
    (fnmatch, where '*' also crosses '/': "!*/test/*")."""
    excludes = [p[1:] for p in patterns if p.startswith("!")]
    found = {
        path
        for pattern in patterns
        if not pattern.startswith("!")
        for path in glob.glob(os.path.expanduser(pattern), recursive=True)
        if not os.path.isdir(path)  # broken links stay, to be reported as unreadable
    }
    return sorted(p for p in found if not any(fnmatch.fnmatch(p, x) for x in excludes))


def sample(paths: list[str], max_docs: int | None) -> list[str]:
    """At most max_docs paths, chosen by hash of the path rather than by name, so a cap
    spreads over the whole tree (not just the packages starting with 'a') yet stays
    reproducible; returned in sorted order."""
    if max_docs is None or len(paths) <= max_docs:
        return paths
    by_hash = sorted(paths, key=lambda p: hashlib.sha256(p.encode()).digest())
    return sorted(by_hash[:max_docs])


def list_documents(
    sources: dict[str, list[str]], max_docs_per_source: int | None = None
) -> list[Document]:
    """Unprocessed documents in canonical order (source order, then path): the order that
    decides which of two duplicates is the original."""
    docs = []
    for name, patterns in sources.items():
        paths = find_files(patterns)
        if not paths:
            raise UserError(
                f"source {name!r}: no files match {patterns}; check the glob "
                "(and quote it, so the shell does not expand it)"
            )
        docs += [Document(name, path) for path in sample(paths, max_docs_per_source)]
    return docs


def read_bytes(path: str) -> bytes:
    """The file's bytes, gunzipped when it ends in .gz (man pages, changelogs)."""
    with open(path, "rb") as file:
        data = file.read()
    return gzip.decompress(data) if path.endswith(".gz") else data


def process_document(
    doc: Document, *, min_chars: int, max_chars: int | None = None
) -> Document:
    """Read, decode, normalize, length-filter and MinHash-sign one document."""
    try:
        data = read_bytes(doc.path)
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        return Document(doc.source, doc.path, status="dropped",
                        reason=f"unreadable:{getattr(err, 'strerror', None) or err}")
    text, note = decode(data)
    if text is None:
        digest = hashlib.sha256(data).hexdigest()
        return Document(doc.source, doc.path, digest, status="dropped", reason=note)
    text = normalize(strip_roff(text) if is_man_page(doc.path) else text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if len(text) < min_chars or (max_chars is not None and len(text) > max_chars):
        reason = "too_short" if len(text) < min_chars else "too_long"
        return Document(doc.source, doc.path, digest, status="dropped", reason=reason)
    return Document(doc.source, doc.path, digest, reason=note, text=text,
                    signature=signature(text))


def map_documents(
    fn: Callable[[Document], Document],
    docs: list[Document],
    workers: int | None = None,
    use_ray: bool = False,
) -> list[Document]:
    """fn over docs, in order: serially, on a spawn-started process pool (fork is unsafe
    once JAX or tokenizers threads exist in the parent), or with Ray Data."""
    if use_ray:
        return _map_ray(fn, docs)
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(docs) < POOL_MIN_DOCS:
        return [fn(doc) for doc in tqdm(docs, desc="ingest", unit="doc")]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.imap(fn, docs, chunksize=8)
        return list(tqdm(results, total=len(docs), desc="ingest", unit="doc"))


def _ray_row(row: dict, fn: Callable[[Document], Document]) -> dict:
    return dataclasses.asdict(fn(Document(**row)))


def _map_ray(fn: Callable[[Document], Document], docs: list[Document]) -> list[Document]:
    try:
        import ray.data
    except ImportError as err:
        raise UserError("--ray needs Ray Data installed: pip install 'ray[data]'") from err
    rows = [{"source": d.source, "path": d.path} for d in docs]
    out = ray.data.from_items(rows).map(partial(_ray_row, fn=fn)).take_all()
    order = {(d.source, d.path): i for i, d in enumerate(docs)}  # Ray may reorder blocks
    results = [Document(**{**row, "signature": _array_or_none(row["signature"])}) for row in out]
    return sorted(results, key=lambda d: order[d.source, d.path])


def _array_or_none(values: object) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.uint32)
