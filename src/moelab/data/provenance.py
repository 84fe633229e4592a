"""Provenance: manifest.jsonl, one record per input document, and the stats table.

A record says where a document came from (source, path, sha256), whether it was kept,
why not (too_short, binary, exact_dup_of:PATH, near_dup_of:PATH, ...), which split it
went to and how many tokens it became, so any shard token can be traced to a file.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from moelab.errors import UserError

if TYPE_CHECKING:
    from moelab.data.ingest import Document

MANIFEST_FILE = "manifest.jsonl"


def manifest_text(docs: Iterable[Document]) -> str:
    return "".join(json.dumps(doc.manifest_record()) + "\n" for doc in docs)


def read_manifest(data_dir: str | Path) -> list[dict]:
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing; run `moelab data prepare --out {data_dir}`")
    return [json.loads(line) for line in path.read_text().splitlines()]


def reason_kind(reason: str) -> str:
    """The filter a reason names, without its detail: near_dup_of:/a/b -> near_dup_of."""
    return reason.partition(":")[0]


def count_documents(records: Iterable[dict]) -> dict[str, Counter]:
    """Per source: documents, kept, train, val, and one count per reason kind."""
    counts: dict[str, Counter] = {}
    for record in records:
        count = counts.setdefault(record["source"], Counter())
        count["docs"] += 1
        count[record["status"]] += 1
        if record["split"]:
            count[record["split"]] += 1
        if record["reason"]:
            count[reason_kind(record["reason"])] += 1
    return counts


def stats_table(records: Sequence[dict], meta: dict) -> str:
    """Rows per source (and a total): document counts per filter and tokens per split."""
    counts = count_documents(records)
    for source, count in counts.items():
        count["train_tokens"] = meta["train_tokens"].get(source, 0)
        count["val_tokens"] = meta["val_tokens"].get(source, 0)
    counts["total"] = sum(counts.values(), Counter())
    fixed = ["docs", "kept", "train", "val", "train_tokens", "val_tokens"]
    reasons = sorted({k for c in counts.values() for k in c} - {*fixed, "dropped"})
    header = ["source", *fixed, *reasons]
    rows = [header] + [[name, *(str(c[k]) for k in header[1:])] for name, c in counts.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    )
