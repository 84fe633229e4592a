"""Files: packed token streams (.npy) for the loader, Parquet shards for the stages.

Packing concatenates a split's documents, each followed by EOS, so the loader can cut
fixed-length windows anywhere without padding. Every file is written under a temporary
name and renamed into place: a reader sees the old file or the new one, never half, and
a stage output that exists is complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def shard_path(data_dir: str | Path, source: str, split: str) -> Path:
    return Path(data_dir) / f"{source}.{split}.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the disk and page cache of small vocabularies."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_stream(path: Path, pieces: Iterable[np.ndarray], total: int, dtype: np.dtype) -> None:
    """A .npy file of `total` tokens filled piece by piece through a memory map of a
    temporary file, renamed into place when whole: memory holds one piece at a time."""
    if total == 0:  # a zero-length file cannot be memory-mapped
        atomic_write(path, lambda file: np.save(file, np.zeros(0, dtype)))
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        stream = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
        filled = 0
        for piece in pieces:
            stream[filled : filled + len(piece)] = piece
            filled += len(piece)
        if filled != total:
            raise RuntimeError(f"{path}: {filled} tokens written, {total} expected")
        stream.flush()
        del stream
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Run write(file) on a temporary file beside path, then rename it to path."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_table(path: Path, table: pa.Table) -> None:
    """A Parquet file, atomically; directories made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda file: pq.write_table(table, file))


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    return pq.read_table(path, columns=columns)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda file: file.write(text.encode()))


def write_json(path: Path, value: object) -> None:
    write_text(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
