"""Deduplication: exact duplicates by content hash, near duplicates by MinHash LSH.

Signatures are computed per document (pure, in the ingest workers); the search is one
pass in canonical order, so the first of a group of duplicates is the one kept and every
dropped document names it. datasketch provides MinHash and the LSH index: the index
finds candidate pairs without comparing every pair, and each candidate is confirmed
by its estimated Jaccard similarity so a band collision alone never drops a document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from datasketch import MinHash, MinHashLSH
from tqdm import tqdm

if TYPE_CHECKING:
    from moelab.data.ingest import Document

NUM_PERM = 128  # permutations per signature: Jaccard estimates to about +-0.04
MAX_THRESHOLD = 0.98  # above this, NUM_PERM permutations leave too few LSH bands
SHINGLE_WORDS = 5  # documents are compared as sets of 5-word windows
_SCHEME = "affine32"  # datasketch's default; needed to rebuild a MinHash from its values


def signature(text: str) -> np.ndarray:
    """MinHash values (uint32 [NUM_PERM]) of the text's lower-cased word 5-grams."""
    words = text.lower().split()
    n = max(1, len(words) - SHINGLE_WORDS + 1)
    shingles = {" ".join(words[i : i + SHINGLE_WORDS]).encode() for i in range(n)}
    sketch = MinHash(num_perm=NUM_PERM, scheme=_SCHEME)
    sketch.update_batch(list(shingles))
    return sketch.hashvalues


def drop_exact_duplicates(docs: list[Document]) -> None:
    """Drop every kept document whose normalized text hash was seen earlier."""
    first: dict[str, Document] = {}
    for doc in docs:
        if doc.kept:
            original = first.setdefault(doc.sha256, doc)
            if original is not doc:
                doc.drop(f"exact_dup_of:{original.path}")


def drop_near_duplicates(docs: list[Document], threshold: float) -> None:
    """Drop every kept document with estimated Jaccard >= threshold to an earlier kept one."""
    index = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
    originals: list[tuple[Document, MinHash]] = []
    for doc in tqdm([d for d in docs if d.kept], desc="near-dup", unit="doc"):
        sketch = MinHash(num_perm=NUM_PERM, hashvalues=doc.signature, scheme=_SCHEME)
        matches = sorted(
            i for i in index.query(sketch) if sketch.jaccard(originals[i][1]) >= threshold
        )
        if matches:
            doc.drop(f"near_dup_of:{originals[matches[0]][0].path}")
        else:
            index.insert(len(originals), sketch)
            originals.append((doc, sketch))
