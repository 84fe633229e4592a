"""Ingest: find each source's files, then read, decode, normalize, score and sign each.

`process_document` is the per-document work. It is pure (its result depends only on
its arguments and the file's bytes), so a shard of documents gives the same bytes
whichever executor (serial, process pool, Ray) runs it.

A document is a whole file, or a piece of one: a file of more than the piece size (prepare's
max_chars, in bytes) is listed as consecutive byte ranges cut at blank lines or line ends
(`pieces`), found by streaming it, and each piece is read alone (seek, then read its
range). So no file is ever read whole, however large, and none is dropped for its length:
a 20 MB changelog becomes twenty 1 MB documents whose provenance names the file and the
range.
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
from functools import partial
from typing import IO

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
    span: tuple[int, int] | None = None  # [start, end) of the file's bytes; None = whole

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
    sources: dict[str, list[str]], max_docs_per_source: int | None = None,
    piece_bytes: int | None = None,
) -> list[Document]:
    """Unprocessed documents in canonical order (source order, then path, then piece): the
    order that decides which of two duplicates is the original. With piece_bytes, a file
    of more content than that is listed as its pieces (None: every file whole)."""
    docs = []
    for name, patterns in sources.items():
        paths = find_files(patterns)
        if not paths:
            raise UserError(
                f"source {name!r}: no files match {patterns}; check the glob "
                "(and quote it, so the shell does not expand it)"
            )
        for path in sample(paths, max_docs_per_source):
            docs += [Document(name, path, span=span) for span in spans(path, piece_bytes)]
    return docs


def open_bytes(path: str) -> IO[bytes]:
    """The file's content: its bytes, gunzipped when it ends in .gz (man pages, changelogs)."""
    return (gzip.open if path.endswith(".gz") else open)(path, "rb")


def content_size(path: str) -> int:
    """Bytes of the file's content without reading it: its size, or for .gz the size that
    the gzip trailer records (ISIZE: exact for the one-member files gzip writes; a
    multi-member file or one over 4 GiB can read smaller, and is then caught by ingest's
    length check as too_long)."""
    if not path.endswith(".gz"):
        return os.stat(path).st_size
    with open(path, "rb") as file:
        file.seek(0, os.SEEK_END)
        if file.tell() < 4:
            return 0
        file.seek(-4, os.SEEK_END)
        return int.from_bytes(file.read(4), "little")


def spans(path: str, piece_bytes: int | None) -> list[tuple[int, int] | None]:
    """[None] (the whole file), or the byte ranges of its pieces when its content is
    larger than piece_bytes. A file that cannot be read here is listed whole: ingest
    records why it is unreadable."""
    try:
        if piece_bytes is None or content_size(path) <= piece_bytes:
            return [None]
        with open_bytes(path) as file:
            return [*pieces(file, piece_bytes)]
    except (OSError, EOFError, zlib.error):
        return [None]


def pieces(file: IO[bytes], max_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges that tile the stream's bytes, each of at most max_bytes: the
    stream is read in pieces and never holds more than max_bytes + 1 bytes (the one byte
    more tells a full last piece from one that has more behind it)."""
    bounds: list[tuple[int, int]] = []
    start, buffer = 0, bytearray()
    while True:
        while len(buffer) <= max_bytes and (chunk := file.read(max_bytes + 1 - len(buffer))):
            buffer += chunk
        if len(buffer) <= max_bytes:  # the stream's end: the rest is the last piece
            if buffer:
                bounds.append((start, start + len(buffer)))
            return bounds
        cut = natural_cut(buffer, max_bytes)
        bounds.append((start, start + cut))
        start += cut
        del buffer[:cut]


def natural_cut(data: bytes | bytearray, limit: int) -> int:
    """Where to end a piece of data[:limit]: after its last blank line, else after its last
    line end, looked for in the second half only (so every piece but a file's last holds
    at least half the limit: no stub is dropped as too_short); else at limit, moved back
    to the start of a UTF-8 character (a line longer than half the limit: minified text)."""
    half = limit // 2
    blank = max(data.rfind(b"\n\n", half, limit), data.rfind(b"\n\r\n", half, limit))
    if blank >= 0:
        return data.index(b"\n", blank + 1) + 1
    line = data.rfind(b"\n", half, limit)
    if line >= 0:
        return line + 1
    cut = limit
    while cut > max(limit - 3, 1) and data[cut] & 0xC0 == 0x80:  # a continuation byte
        cut -= 1
    return cut


def read_bytes(path: str, limit: int | None = None,
               span: tuple[int, int] | None = None) -> bytes:
    """The file's content, or the span of it (seek, then read: a .gz is decompressed up to
    the span's start in small chunks); of a whole file at most limit + 1 bytes, so that a
    huge file costs no more memory than the limit."""
    with open_bytes(path) as file:
        if span is not None:
            file.seek(span[0])
            return file.read(span[1] - span[0])
        return file.read() if limit is None else file.read(limit + 1)


def _bytes_digest(path: str) -> str:
    """sha256 of the (gunzipped) bytes, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open_bytes(path) as file:
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
    """Read, decode, normalize, length-filter, quality-score and MinHash-sign one document
    (a whole file or a piece of one). A whole file of more than MAX_BYTES_PER_CHAR *
    max_chars bytes is too long whatever its text: it is not read whole (its sha256 is
    then that of its bytes); one listed in pieces never is too long (a piece of at most
    max_chars bytes has at most max_chars characters)."""
    verdict = partial(Document, doc.source, doc.path, span=doc.span)
    limit = None if max_chars is None else MAX_BYTES_PER_CHAR * max_chars
    try:
        data = read_bytes(doc.path, limit, doc.span)
        if doc.span is None and limit is not None and len(data) > limit:
            return verdict(_bytes_digest(doc.path), status="dropped", reason="too_long")
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        return verdict(status="dropped",
                       reason=f"unreadable:{getattr(err, 'strerror', None) or err}")
    text, note = decode(data)
    if text is None:
        digest = hashlib.sha256(data).hexdigest()
        return verdict(digest, status="dropped", reason=note)
    text = normalize(strip_roff(text) if is_man_page(doc.path) else text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if len(text) < min_chars or (max_chars is not None and len(text) > max_chars):
        reason = "too_short" if len(text) < min_chars else "too_long"
        return verdict(digest, status="dropped", reason=reason)
    scores = quality.scores(text, quality.is_code(doc.path))
    if doc.span is not None:  # a piece's length is the splitter's, not its author's: the
        # word-count maximum (Gopher's guard against freak documents) would drop every
        # 1 MB piece of prose (~170k words), so a piece is judged by its content only
        thresholds = {**thresholds, "word_count": (thresholds.get("word_count", (None,))[0],
                                                   None)}
    failed = quality.failed(scores, thresholds)
    if failed:
        return verdict(digest, status="dropped", reason=f"quality_{failed}", quality=scores)
    return verdict(digest, reason=note, quality=scores, text=text, signature=signature(text))
