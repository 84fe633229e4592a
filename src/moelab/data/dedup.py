"""Deduplication maths: MinHash signatures, LSH band keys, duplicate clusters.

Exact duplicates share the sha256 of their normalized text. Near duplicates are found as
in datatrove and Marin's DataKit: a MinHash signature per document (datasketch), cut into
`bands` bands of `rows` values; two documents that agree on a whole band are candidates;
a candidate pair counts only if its estimated Jaccard similarity (the share of equal
signature values) reaches the threshold, so a band collision alone never drops a
document; confirmed pairs are merged by union-find, and the first document of a cluster in
canonical order is the one kept. The stage code in `stages` partitions the band keys by
hash so no task holds more than its share of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
from datasketch import MinHash
from datasketch.lsh import _optimal_param

NUM_PERM = 128  # permutations per signature: Jaccard estimates to about +-0.04
MAX_THRESHOLD = 0.98  # above this, NUM_PERM permutations leave too few LSH bands
SHINGLE_WORDS = 5  # documents are compared as sets of 5-word windows
_SCHEME = "affine32"  # datasketch's default
BUCKET_WINDOW = 32  # candidate partners per document in one band bucket


def signature(text: str) -> np.ndarray:
    """MinHash values (uint32 [NUM_PERM]) of the text's lower-cased word 5-grams."""
    words = text.lower().split()
    n = max(1, len(words) - SHINGLE_WORDS + 1)
    shingles = {" ".join(words[i : i + SHINGLE_WORDS]).encode() for i in range(n)}
    sketch = MinHash(num_perm=NUM_PERM, scheme=_SCHEME)
    sketch.update_batch(list(shingles))
    return sketch.hashvalues


def lsh_bands(threshold: float) -> tuple[int, int]:
    """(bands, rows): datasketch's choice for the threshold, equal weight on false
    positives and false negatives; (9, 13) at 0.8."""
    return _optimal_param(threshold, NUM_PERM, 0.5, 0.5)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[int]:
    """One 64-bit key per band: equal keys <=> equal band values (up to 2^-64)."""
    return [
        int.from_bytes(hashlib.blake2b(sig[b * rows : (b + 1) * rows].tobytes(),
                                       digest_size=8, person=b.to_bytes(8, "little")).digest(),
                       "little")
        for b in range(bands)
    ]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity of two documents from their signatures."""
    return float(np.mean(a == b))


def bucket_pairs(doc_ids: list[int]) -> Iterable[tuple[int, int]]:
    """Candidate pairs of one band bucket (ids sorted): each document with the next
    BUCKET_WINDOW ones. A bucket of up to BUCKET_WINDOW + 1 documents gives every pair
    (so two documents similar to each other but not to the first are still seen); a
    huge one (thousands of near-identical license files) gives k * BUCKET_WINDOW pairs,
    not k^2, and its members still chain into one cluster through their neighbours."""
    return ((a, b) for i, a in enumerate(doc_ids) for b in doc_ids[i + 1 : i + 1 + BUCKET_WINDOW])


def cluster_roots(pairs: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Union-find over confirmed pairs: {doc_id: smallest doc_id of its cluster} for
    every document in a pair (the smallest maps to itself)."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]  # path halving
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: root(x) for x in parent}
