"""Ingest: find each source's files, then read, decode, normalize, score and sign each.

`process_document` is the per-document work. It is pure (its result depends only on
its arguments and the file's bytes), so a shard of documents gives the same bytes
whichever executor (serial, process pool, Ray) runs it.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import os
import re
import stat
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from moelab.data import quality
from moelab.data.dedup import signature
from moelab.data.text import decode, is_man_page, normalize, strip_roff
from moelab.errors import UserError

_SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")  # names become shard file names
MAX_BYTES_PER_CHAR = 4  # UTF-8: more bytes than 4 x max_chars cannot be max_chars of text


@dataclass
class Document:
    """One file of one source, and what the pipeline decided about it."""

    source: str
    path: str
    sha256: str = ""  # of the normalized text; of the raw bytes when it is not text
    status: str = "kept"  # "kept" or "dropped"
    reason: str = ""  # why dropped (too_short, near_dup_of:PATH, ...) or a note if kept
    quality: dict[str, float] = field(default_factory=dict)  # quality.scores(), if scored
    text: str = ""
    signature: np.ndarray | None = None  # MinHash values, for near-duplicate search

    @property
    def kept(self) -> bool:
        return self.status == "kept"


def source_globs(sources: dict[str, str | list[str]]) -> dict[str, list[str]]:
    """Check source names and give every source a list of patterns."""
    if not sources:
        raise UserError("no sources given; pass --source NAME=GLOB (e.g. code='src/**/*.py')")
    for name in sources:
        if not _SOURCE_NAME.fullmatch(name):
            raise UserError(f"source name {name!r} must be letters, digits, '_' or '-'")
    return {name: [p] if isinstance(p, str) else list(p) for name, p in sources.items()}


def is_document(path: str) -> bool:
    """A regular file, or a broken link (kept, to be reported as unreadable). Not a
    directory, nor a named pipe, socket or device: reading those blocks or never ends."""
    try:
        mode = os.stat(path).st_mode  # one stat per matched path (~56k for the default)
    except OSError:  # what os.path.exists says False to
        return True
    return stat.S_ISREG(mode)


def find_files(patterns: list[str]) -> list[str]:
    """Sorted files matching the patterns; a pattern starting with '!' excludes
    (fnmatch, where '*' also crosses '/': "!*/test/*")."""
    excludes = [p[1:] for p in patterns if p.startswith("!")]
    found = {
        path
        for pattern in patterns
        if not pattern.startswith("!")
        for path in glob.glob(os.path.expanduser(pattern), recursive=True)
        if is_document(path)
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


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """The file's bytes, gunzipped when it ends in .gz (man pages, changelogs); at most
    limit + 1 of them, so that a huge file costs no more memory than the limit."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as file:
        return file.read() if limit is None else file.read(limit + 1)


def _bytes_digest(path: str) -> str:
    """sha256 of the (gunzipped) bytes, read a megabyte at a time."""
    digest = hashlib.sha256()
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def process_document(
    doc: Document,
    *,
    min_chars: int,
    max_chars: int | None = None,
    thresholds: Mapping = quality.DEFAULT_THRESHOLDS,
) -> Document:
    """Read, decode, normalize, length-filter, quality-score and MinHash-sign one document.
    A file of more than MAX_BYTES_PER_CHAR * max_chars bytes is too long whatever its
    text: it is not read whole (its sha256 is then that of its bytes)."""
    limit = None if max_chars is None else MAX_BYTES_PER_CHAR * max_chars
    try:
        data = read_bytes(doc.path, limit)
        if limit is not None and len(data) > limit:
            return Document(doc.source, doc.path, _bytes_digest(doc.path), status="dropped",
                            reason="too_long")
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
    scores = quality.scores(text, quality.is_code(doc.path))
    failed = quality.failed(scores, thresholds)
    if failed:
        return Document(doc.source, doc.path, digest, status="dropped",
                        reason=f"quality_{failed}", quality=scores)
    return Document(doc.source, doc.path, digest, reason=note, quality=scores, text=text,
                    signature=signature(text))
