"""Provenance: the manifest, one record per input document, sharded; and the stats table.

A record says where a document came from (source, path, and for a piece of a long file
its byte range of the file's content, byte_start..byte_end; sha256), whether it was kept,
why not (too_short, binary, quality_<score>, exact_dup_of:PATH, near_dup_of:PATH where
PATH is the kept representative of its duplicate cluster), its quality scores, which
split it went to and how many tokens it became, so any shard token can be traced to a
file. The manifest is Parquet shards under manifest/, one per input shard, in canonical
document order; readers stream them one shard at a time.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from moelab.data.quality import SCORES
from moelab.data.shards import read_table
from moelab.errors import UserError
from moelab.schema import SchemaError, bounded, brief

MANIFEST_DIR = "manifest"
QUALITY_TYPE = pa.struct([(name, pa.float64()) for name in SCORES])
MANIFEST_SCHEMA = pa.schema([
    ("doc_id", pa.int64()), ("source", pa.string()), ("path", pa.string()),
    ("sha256", pa.string()), ("status", pa.string()), ("reason", pa.string()),
    ("split", pa.string()), ("tokens", pa.int64()), ("quality", QUALITY_TYPE),
    ("byte_start", pa.int64()), ("byte_end", pa.int64()),
])
# Manifests written before long files were split lack these: each of their documents is
# a whole file, as a null range says.
SPAN_COLUMNS = ("byte_start", "byte_end")


def span_of(record: dict) -> tuple[int, int] | None:
    """A list, ingest or manifest record's byte range of its file; None: the whole file."""
    start = record.get("byte_start")
    return None if start is None else (start, record["byte_end"])


def locator(path: str, span: tuple[int, int] | None = None) -> str:
    """A document's name in drop reasons and content hashes: its path, and for a piece of
    a file its byte range, "path[start:end]"."""
    return path if span is None else f"{path}[{span[0]}:{span[1]}]"


def manifest_shards(data_dir: str | Path) -> list[Path]:
    return sorted((Path(data_dir) / MANIFEST_DIR).glob("part-*.parquet"))


def read_manifest(data_dir: str | Path) -> Iterator[dict]:
    """Every record, in canonical order, one shard in memory at a time; quality holds
    only the scores computed for the document."""
    shards = manifest_shards(data_dir)
    if not shards:
        raise UserError(f"{Path(data_dir) / MANIFEST_DIR} is missing; run "
                        f"`moelab data prepare --out {data_dir}`")
    for shard in shards:
        for record in _manifest_table(shard).to_pylist():
            record["quality"] = {k: v for k, v in (record["quality"] or {}).items()
                                 if v is not None}
            yield record


def content_sha256(records: Iterable[dict]) -> str:
    """sha256 over every input file's (source, path, sha256), in canonical order: two
    datasets built from the same files with the same settings share it, and a default
    corpus that differs from another machine's (other packages installed, another Python)
    shows it here before any loss is compared."""
    digest = hashlib.sha256()
    for record in records:
        where = locator(record["path"], span_of(record))
        digest.update(f"{record['source']}\t{where}\t{record['sha256']}\n".encode())
    return digest.hexdigest()


def _manifest_table(shard: Path):
    """One manifest shard, refused in one line when it is not the parquet table prepare
    wrote (a damaged or replaced file)."""
    try:
        table = read_table(shard)
    except (pa.ArrowException, OSError) as err:
        raise SchemaError(shard, f"not a readable manifest shard ({bounded(str(err), 160)}); "
                                 "re-prepare the dataset") from None
    for name in SPAN_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, pa.int64()))
    have = {field.name: field.type for field in table.schema}
    wrong = [f"{f.name} ({have.get(f.name, 'missing')})" for f in MANIFEST_SCHEMA
             if have.get(f.name) != f.type]
    if wrong:
        raise SchemaError(shard, f"manifest columns of the wrong type: {brief(wrong)}; "
                                 "re-prepare the dataset")
    return table


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


def stats_table(records: Iterable[dict], meta: dict) -> str:
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
