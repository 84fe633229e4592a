"""Shards: one packed token stream per (source, split), as a memory-mappable .npy file.

Packing concatenates a split's documents, each followed by EOS, so the loader can cut
fixed-length windows anywhere without padding. Every file is written under a temporary
name and renamed into place: a reader sees the old file or the new one, never half.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np
from tqdm import tqdm

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from moelab.data.ingest import Document

ENCODE_CHUNK = 64  # documents per encode_batch call: a progress tick, bounded memory


def shard_path(data_dir: str | Path, source: str, split: str) -> Path:
    return Path(data_dir) / f"{source}.{split}.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the disk and page cache of small vocabularies."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def pack(
    tokenizer: Tokenizer, docs: Sequence[Document], eos_id: int, desc: str
) -> np.ndarray:
    """Encode docs and concatenate them, EOS after each; sets doc.tokens (EOS counted)."""
    pieces = []
    for start in tqdm(range(0, len(docs), ENCODE_CHUNK), desc=desc, unit="chunk"):
        chunk = docs[start : start + ENCODE_CHUNK]
        encodings = tokenizer.encode_batch_fast([d.text for d in chunk])
        for doc, encoding in zip(chunk, encodings, strict=True):
            pieces.append(np.array([*encoding.ids, eos_id], dtype=np.int64))
            doc.tokens = len(pieces[-1])
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    return stream.astype(token_dtype(tokenizer.get_vocab_size()))


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


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the temporary files (`.NAME.XXXX.tmp`) of `atomic_write`s that a SIGKILL cut
    short: nothing reads them, and they would pile up with every interrupted prepare."""
    stale = sorted(directory.rglob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def write_array(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda file: np.save(file, array))


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda file: file.write(text.encode()))


def write_json(path: Path, value: object) -> None:
    write_text(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
