"""Quality buckets and cells: domain x quality bucket, the units a mixture weighs.

moelab's quality scores are several heuristics (quality.SCORES), not one classifier's
probability as in DataKit. A document's quality is made one number here: for each score
with one bound in quality.DEFAULT_THRESHOLDS (a maximum: lower is better; a minimum:
higher is better), the document's rank among the calibration sample's values of that
score (0 = worst, 1 = best), averaged over the scores the document has. Two-sided and
unbounded scores (word count, mean word length, line punctuation) say nothing about
better or worse and are left out. The bucket cuts are the quantiles of that number on the
calibration sample (equal-mass buckets: DataKit's cuts at 0.2/0.4/0.6/0.8 of a calibrated
probability are the same idea), so bucket q0 is the worst fifth and q4 the best.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from moelab.data.quality import DEFAULT_THRESHOLDS

TAIL = "tail"  # the cell that tiny cells are merged into
CELL_PREFIX = "cell:"  # how data.mixture names a cell: "cell:d03/q4"
CELLS_DIR = "cells"
ASSIGNMENTS_FILE = "assignments.parquet"
REPORT_FILE = "report.json"
# +1: higher is better (a minimum bound), -1: lower is better (a maximum bound)
ORIENTATION = {name: (1 if low is not None else -1)
               for name, (low, high) in DEFAULT_THRESHOLDS.items()
               if (low is None) != (high is None)}


def reference(sample: Iterable[dict[str, float]]) -> dict[str, list[float]]:
    """Per oriented score, the sorted values of the calibration sample's documents."""
    values: dict[str, list[float]] = {name: [] for name in ORIENTATION}
    for scores in sample:
        for name, value in scores.items():
            if name in values and value is not None:
                values[name].append(float(value))
    return {name: sorted(v) for name, v in values.items() if v}


def composite(scores: dict[str, float], ref: dict[str, list[float]]) -> float:
    """The document's mean oriented rank in [0, 1] among the sample (ties: mid-rank);
    0.5 when it has none of the oriented scores."""
    ranks = []
    for name, value in scores.items():
        if name not in ref or value is None:
            continue
        values = ref[name]
        below = np.searchsorted(values, value, "left")
        rank = (below + np.searchsorted(values, value, "right")) / 2 / len(values)
        ranks.append(rank if ORIENTATION[name] > 0 else 1 - rank)
    return float(np.mean(ranks)) if ranks else 0.5


def cuts(values: np.ndarray, buckets: int) -> list[float]:
    """The buckets - 1 inner quantiles of the sample's composite qualities."""
    if len(values) == 0:
        return [0.5] * (buckets - 1)
    return [float(q) for q in np.quantile(values, np.arange(1, buckets) / buckets)]


def bucket(quality: float, cut_points: list[float]) -> int:
    """0 (worst) .. len(cut_points) (best)."""
    return int(np.searchsorted(cut_points, quality, "right"))


def cell_name(domain: int, quality_bucket: int) -> str:
    return f"d{domain:02d}/q{quality_bucket}"


def cell_file_stem(name: str) -> str:
    """A cell's stream files are CELLS_DIR/<stem>.<split>.npy."""
    return name.replace("/", "-")


def merge_tiny(train_tokens: dict[str, int], min_fraction: float) -> dict[str, str]:
    """{cell: final cell}: cells under min_fraction of the train tokens go to TAIL. If only
    one cell would be tiny it still goes to the tail (a tail of one is a renamed cell, which
    keeps the rule simple to state); if every cell is tiny, none is merged."""
    total = sum(train_tokens.values())
    tiny = {c for c, n in train_tokens.items() if n < min_fraction * total}
    if len(tiny) == len(train_tokens):
        tiny = set()
    return {c: TAIL if c in tiny else c for c in train_tokens}
