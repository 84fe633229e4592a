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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

K = TypeVar("K")  # a stream's key, e.g. (source, split)


def shard_path(data_dir: str | Path, source: str, split: str) -> Path:
    return Path(data_dir) / f"{source}.{split}.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the disk and page cache of small vocabularies."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_streams(paths: Mapping[K, Path], totals: Mapping[K, int],
                  pieces: Iterable[tuple[K, np.ndarray]], dtype: np.dtype) -> None:
    """Several .npy streams (totals[key] tokens each) filled in one pass over `pieces`
    ((key, tokens), each stream's pieces in its order), appended to temporary files that
    are renamed into place when all are whole. Memory holds one piece: plain appends, not
    a memory map, whose dirty pages would count in the writer's RSS as the streams grow."""
    temps: dict[K, str] = {}
    files: dict[K, IO[bytes]] = {}
    try:
        for key, path in paths.items():
            fd, temps[key] = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                              suffix=".tmp")
            files[key] = os.fdopen(fd, "wb")
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                      "shape": (totals[key],)}  # the header np.save writes
            np.lib.format.write_array_header_1_0(files[key], header)
        filled = dict.fromkeys(paths, 0)
        for key, piece in pieces:
            files[key].write(np.ascontiguousarray(piece, dtype).tobytes())
            filled[key] += len(piece)
        for key, file in files.items():
            file.close()
            if filled[key] != totals[key]:
                raise RuntimeError(f"{paths[key]}: {filled[key]} tokens written, "
                                   f"{totals[key]} expected")
        for key, path in paths.items():
            os.replace(temps.pop(key), path)
    except BaseException:
        for file in files.values():
            file.close()
        for temp in temps.values():
            os.unlink(temp)
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
