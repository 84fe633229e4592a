"""The stages of `prepare`, each a task per shard (or per hash partition) over Parquet.

    list       (driver)  list/part-S          doc_id, source, path, byte range (pieces of
                                              a long file), in canonical order
    ingest     per shard ingest/part-S        read, decode, normalize, filter, score, sign
                         exact/part-S         (sha256, doc_id, path), a row group per partition
    exact      per part  exact/dropped-P      all but the first of each sha256
               (one)     exact/dropped        merged in doc_id order
    bands      per shard bands/part-S         (band key, doc_id), a row group per partition
    pairs      per part  pairs/part-P         candidate pairs: documents sharing a key
    clusters   (one)     clusters.parquet     pairs confirmed by Jaccard, union-find
    decide     per shard decided/part-S       the manifest minus split and tokens
    tokenizer  (one)     tokenizer.json       BPE on a bounded, seeded sample of train text
    tokenize   per shard tokens/part-S, manifest/part-S

A task is a pure function of its inputs and writes each output atomically, so a task
whose outputs all exist is skipped: a killed prepare resumes where it stopped and writes
the same bytes. Parquet because its columns can be read alone (the bands stage reads
signatures without the text), row-group statistics let a task read only its doc_id
range of a sorted file, it is compressed, and every engine (Ray Data, datatrove, pandas,
DuckDB) reads it. Memory: a shard task holds one shard; a partition task holds 1/P of
the keys; `clusters` holds the candidate pairs and the near-dropped ids (it grows with
the duplicates, not the corpus, like datatrove's cluster stage); the tokenizer sees a
sample capped in characters, streamed; tokenize encodes ENCODE_CHARS at a time with one
tokenizer per process (prepare's per-stage RSS probe is how these were found). The hash
shuffle of a keyed stage writes one map file per shard, each partition's rows in row
groups of their own tagged by a `part` column: a partition task reads only its row groups
of every map file (shards files per stage, not shards x partitions).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import groupby, islice
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from moelab.data import dedup
from moelab.data.executor import Task
from moelab.data.ingest import Document, process_document
from moelab.data.provenance import MANIFEST_SCHEMA, QUALITY_TYPE, locator, span_of
from moelab.data.shards import atomic_write, read_table, write_table, write_text
from moelab.data.tokenizer import EOS, TOKENIZER_FILE, train_tokenizer

SPAN = [("byte_start", pa.int64()), ("byte_end", pa.int64())]  # null: the whole file
LIST = pa.schema([("doc_id", pa.int64()), ("source", pa.string()), ("path", pa.string()),
                  *SPAN])
INGEST = pa.schema([
    ("doc_id", pa.int64()), ("source", pa.string()), ("path", pa.string()), *SPAN,
    ("sha256", pa.string()), ("status", pa.string()), ("reason", pa.string()),
    ("quality", QUALITY_TYPE), ("chars", pa.int64()), ("text", pa.large_string()),
    ("signature", pa.list_(pa.uint32())),
])
HASHES = pa.schema([("sha256", pa.string()), ("doc_id", pa.int64()), ("path", pa.string())])
DROPPED = pa.schema([("doc_id", pa.int64()), ("of", pa.int64()), ("reason", pa.string())])
BANDS = pa.schema([("key", pa.uint64()), ("doc_id", pa.int64())])
PAIRS = pa.schema([("a", pa.int64()), ("b", pa.int64())])
TOKENS = pa.schema([("doc_id", pa.int64()), ("source", pa.string()), ("split", pa.string()),
                    ("ids", pa.list_(pa.uint32()))])
# Characters per encode_batch call: the Encoding objects (ids, token strings, masks; ~100
# bytes a token) of one call are a task's largest allocation, so a chunk is bounded in
# text, not in documents (a shard of 32 long documents would otherwise cost ~200 MB).
ENCODE_CHARS = 500_000
ROW_GROUP = 65_536  # rows per Parquet row group of the merged drop lists


@dataclass(frozen=True)
class Plan:
    """Everything a task needs; small and picklable, sent to every worker."""

    work: str  # the stage directory, a path every worker sees
    n_docs: int
    shard_docs: int  # documents per shard
    partitions: int  # hash partitions of the exact and band keys
    min_chars: int
    max_chars: int | None
    thresholds: dict  # quality score -> (min, max)
    near_dup_threshold: float
    bands: int
    rows: int
    vocab_size: int
    tokenizer_sample_chars: int
    seed: int
    chat_tokens: bool = False  # append the chat template's special tokens to the vocabulary

    @property
    def shards(self) -> int:
        return max(1, -(-self.n_docs // self.shard_docs))

    def path(self, *parts: str) -> Path:
        return Path(self.work, *parts)

    def shard_file(self, stage: str, shard: int) -> Path:
        return self.path(stage, f"part-{shard:05d}.parquet")

    def read_partition(self, stage: str, part: int) -> pa.Table:
        """Partition `part` of a keyed stage: its row groups of every shard's map file."""
        return pa.concat_tables([read_partition(self.shard_file(stage, s), part)
                                 for s in range(self.shards)])

    def doc_range(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_docs, min(self.n_docs, (shard + 1) * self.shard_docs)


def done(*outputs: Path) -> bool:
    """A task is complete when all its outputs exist (each was renamed into place whole)."""
    return all(path.exists() for path in outputs)


def write_partitioned(path: Path, table: pa.Table, part: np.ndarray) -> None:
    """One map file of a hash shuffle: the rows of each partition (part[i] is row i's) in
    a row group of their own, in their order, with a `part` column whose row-group
    statistics tell a reader which groups are its own."""
    order = np.argsort(part, kind="stable")
    table = table.take(pa.array(order)).append_column("part", pa.array(part[order], pa.int32()))
    ends = np.cumsum(np.bincount(part, minlength=1))

    def write(file: IO[bytes]) -> None:
        with pq.ParquetWriter(file, table.schema) as writer:
            for start, end in zip([0, *ends[:-1]], ends, strict=True):
                if end > start:
                    writer.write_table(table.slice(start, end - start))

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)


def read_partition(path: Path, part: int) -> pa.Table:
    """The rows of partition `part` in a map file, without the `part` column."""
    file = pq.ParquetFile(path)
    column = file.schema_arrow.get_field_index("part")
    groups = [g for g in range(file.num_row_groups)
              if file.metadata.row_group(g).column(column).statistics.min == part]
    return file.read_row_groups(groups).drop_columns(["part"])


def write_list(plan: Plan, docs: list[Document]) -> None:
    for shard in range(plan.shards):
        out = plan.shard_file("list", shard)
        if not done(out):
            lo, hi = plan.doc_range(shard)
            rows = [{"doc_id": i, "source": docs[i].source, "path": docs[i].path,
                     **_span_columns(docs[i].span)} for i in range(lo, hi)]
            write_table(out, pa.Table.from_pylist(rows, schema=LIST))


# ---------------------------------------------------------------------------- ingest


def ingest(plan: Plan, shard: int) -> None:
    """Process the shard's documents; route each kept sha256 to its exact partition."""
    out, exact = plan.shard_file("ingest", shard), plan.shard_file("exact", shard)
    if done(out, exact):
        return
    rows = []
    for listed in read_table(plan.shard_file("list", shard)).to_pylist():
        doc = process_document(Document(listed["source"], listed["path"], span=span_of(listed)),
                               min_chars=plan.min_chars, max_chars=plan.max_chars,
                               thresholds=plan.thresholds)
        rows.append({"doc_id": listed["doc_id"], "source": doc.source, "path": doc.path,
                     **_span_columns(doc.span), "sha256": doc.sha256, "status": doc.status,
                     "reason": doc.reason,
                     "quality": doc.quality or None, "chars": len(doc.text) if doc.kept else 0,
                     "text": doc.text if doc.kept else None,
                     "signature": None if doc.signature is None else doc.signature.tolist()})
    table = pa.Table.from_pylist(rows, schema=INGEST)
    kept = table.filter(pc.equal(table["status"], "kept"))
    part = np.array([int(h[:8], 16) % plan.partitions for h in kept["sha256"].to_pylist()],
                    np.int64)
    hashes = pa.table({"sha256": kept["sha256"], "doc_id": kept["doc_id"],
                       "path": pa.array(_locators(kept), pa.string())}, schema=HASHES)
    write_partitioned(exact, hashes, part)
    write_table(out, table)  # last: the ingest shard's presence means the task is done


def _span_columns(span: tuple[int, int] | None) -> dict[str, int | None]:
    return dict(zip(("byte_start", "byte_end"), span or (None, None), strict=True))


def _locators(table: pa.Table) -> list[str]:
    """What a drop reason calls each row's document: its path, and a piece's byte range."""
    return [locator(row["path"], span_of(row))
            for row in table.select(["path", "byte_start", "byte_end"]).to_pylist()]


def exact_dedup(plan: Plan, part: int) -> None:
    """In one sha256 partition, drop every document but the first of its hash."""
    out = plan.path("exact", f"dropped-{part:03d}.parquet")
    if done(out):
        return
    table = plan.read_partition("exact", part)
    rows = table.sort_by([("sha256", "ascending"), ("doc_id", "ascending")]).to_pylist()
    dropped = []
    for _, group in groupby(rows, key=lambda r: r["sha256"]):
        first, *rest = group
        dropped += [{"doc_id": r["doc_id"], "of": first["doc_id"],
                     "reason": f"exact_dup_of:{first['path']}"} for r in rest]
    write_table(out, pa.Table.from_pylist(dropped, schema=DROPPED).sort_by("doc_id"))


def merge_exact(plan: Plan) -> None:
    """exact/dropped.parquet: every partition's drops merged in doc_id order (a k-way
    merge, one batch per partition in memory), in row groups, so that a shard task reads
    only the row groups of its own doc_id range."""
    out = plan.path("exact", "dropped.parquet")
    if done(out):
        return

    def rows(path: Path) -> Iterator[dict]:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP):
            yield from batch.to_pylist()

    merged = heapq.merge(*(rows(f) for f in _exact_partition_files(plan)),
                         key=lambda r: r["doc_id"])

    def write(file: IO[bytes]) -> None:
        with pq.ParquetWriter(file, DROPPED) as writer:
            while chunk := list(islice(merged, ROW_GROUP)):
                writer.write_table(pa.Table.from_pylist(chunk, schema=DROPPED))

    atomic_write(out, write)


def _dropped_in(plan: Plan, files: list[Path], shard: int) -> dict[int, str]:
    """{doc_id: reason} of the shard's documents in dropped files sorted by doc_id:
    the row-group statistics let Parquet skip every other shard's rows."""
    lo, hi = plan.doc_range(shard)
    found: dict[int, str] = {}
    for path in files:
        mine = pq.read_table(path, filters=[("doc_id", ">=", lo), ("doc_id", "<", hi)])
        found.update(zip(mine["doc_id"].to_pylist(), mine["reason"].to_pylist(), strict=True))
    return found


def _exact_partition_files(plan: Plan) -> list[Path]:
    return [plan.path("exact", f"dropped-{p:03d}.parquet") for p in range(plan.partitions)]


# ---------------------------------------------------------------------- near dedup


def band(plan: Plan, shard: int) -> None:
    """Band keys of the shard's documents that are kept and not exact duplicates."""
    out = plan.shard_file("bands", shard)
    if done(out):
        return
    table = read_table(plan.shard_file("ingest", shard), ["doc_id", "status", "signature"])
    exact = _dropped_in(plan, [plan.path("exact", "dropped.parquet")], shard)
    keys: list[int] = []
    ids: list[int] = []
    for doc_id, status, sig in zip(*(table[c].to_pylist() for c in table.column_names),
                                   strict=True):
        if status != "kept" or doc_id in exact:
            continue
        doc_keys = dedup.band_keys(np.asarray(sig, np.uint32), plan.bands, plan.rows)
        keys += doc_keys
        ids += [doc_id] * len(doc_keys)
    key_array = np.array(keys, np.uint64)
    write_partitioned(out, pa.table({"key": pa.array(key_array, pa.uint64()),
                                     "doc_id": pa.array(ids, pa.int64())}),
                      (key_array % np.uint64(plan.partitions)).astype(np.int64))


def pair(plan: Plan, part: int) -> None:
    """Candidate pairs of one key partition: documents sharing a band key."""
    out = plan.shard_file("pairs", part)
    if done(out):
        return
    table = plan.read_partition("bands", part)
    table = table.sort_by([("key", "ascending"), ("doc_id", "ascending")])
    pairs = set()
    for _, group in groupby(zip(table["key"].to_pylist(), table["doc_id"].to_pylist(),
                                strict=True), key=lambda kv: kv[0]):
        pairs.update(dedup.bucket_pairs([doc_id for _, doc_id in group]))
    a, b = zip(*sorted(pairs), strict=True) if pairs else ((), ())
    write_table(out, pa.Table.from_arrays([pa.array(a, pa.int64()), pa.array(b, pa.int64())],
                                          schema=PAIRS))


def cluster(plan: Plan) -> None:
    """Confirm candidate pairs by estimated Jaccard, merge them into clusters; every
    member but the cluster's first document is dropped, naming that one. An exact copy of
    a dropped member names it too: the manifest always points at the document kept."""
    out = plan.path("clusters.parquet")
    if done(out):
        return
    pairs = set()
    for part in range(plan.partitions):
        table = read_table(plan.shard_file("pairs", part))
        pairs.update(zip(table["a"].to_pylist(), table["b"].to_pylist(), strict=True))
    wanted = pa.array(sorted({x for p in pairs for x in p}), pa.int64())
    signatures, paths = {}, {}
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("ingest", shard),
                           ["doc_id", "path", "byte_start", "byte_end", "signature"])
        table = table.filter(pc.is_in(table["doc_id"], wanted))
        for doc_id, path, sig in zip(table["doc_id"].to_pylist(), _locators(table),
                                     table["signature"].to_pylist(), strict=True):
            signatures[doc_id], paths[doc_id] = np.asarray(sig, np.uint32), path
    confirmed = [(a, b) for a, b in sorted(pairs)
                 if dedup.jaccard(signatures[a], signatures[b]) >= plan.near_dup_threshold]
    roots = dedup.cluster_roots(confirmed)
    dropped = {x: r for x, r in roots.items() if x != r}
    exact = pq.ParquetFile(plan.path("exact", "dropped.parquet"))
    for batch in exact.iter_batches(batch_size=ROW_GROUP, columns=["doc_id", "of"]):
        for x, of in zip(batch["doc_id"].to_pylist(), batch["of"].to_pylist(), strict=True):
            if of in dropped:  # of's own exact copies are behind its cluster's first one
                dropped[x] = dropped[of]
    dropped = [{"doc_id": x, "of": r, "reason": f"near_dup_of:{paths[r]}"}
               for x, r in sorted(dropped.items())]
    write_table(out, pa.Table.from_pylist(dropped, schema=DROPPED))


# ------------------------------------------------------------- decide and tokenize


def decide(plan: Plan, shard: int) -> None:
    """The shard's manifest without split and tokens: ingest's verdict, then dedup's."""
    out = plan.shard_file("decided", shard)
    if done(out):
        return
    table = read_table(plan.shard_file("ingest", shard),
                       ["doc_id", "source", "path", "byte_start", "byte_end", "sha256", "status",
                        "reason", "quality"])
    dropped = _dropped_in(plan, [plan.path("exact", "dropped.parquet"),
                                 plan.path("clusters.parquet")], shard)
    rows = table.to_pylist()
    for row in rows:
        if row["doc_id"] in dropped:
            row["status"], row["reason"] = "dropped", dropped[row["doc_id"]]
    write_table(out, pa.Table.from_pylist(rows, schema=table.schema))


def split_counts(plan: Plan, val_fraction: float) -> dict[str, dict]:
    """Per source: kept documents, how many hash into val, and the extreme hashes, which
    is all `split_of` needs to split one document without seeing the others."""
    counts: dict[str, dict] = {}
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("decided", shard), ["source", "sha256", "status"])
        for source, sha, status in zip(*(table[c].to_pylist() for c in table.column_names),
                                       strict=True):
            count = counts.setdefault(source, {"kept": 0, "val": 0, "min": "", "max": ""})
            if status == "kept":  # "" sorts before every hash: the first kept one sets both
                count["kept"] += 1
                count["val"] += _hashes_to_val(sha, val_fraction)
                count["min"], count["max"] = min(count["min"] or sha, sha), max(count["max"], sha)
    return counts


def _hashes_to_val(sha: str, val_fraction: float) -> bool:
    return int(sha[:8], 16) < val_fraction * 16**8


def split_of(sha: str, count: dict, val_fraction: float) -> str:
    """About val_fraction of a source's kept documents, chosen by content hash (a
    document's split does not change as files are added); with two or more documents,
    at least one in each split: the smallest hash goes to val, the largest to train."""
    if count["kept"] >= 2 and count["val"] == 0 and sha == count["min"]:
        return "val"
    if count["kept"] >= 2 and count["val"] == count["kept"] and sha == count["max"]:
        return "train"
    return "val" if count["kept"] >= 2 and _hashes_to_val(sha, val_fraction) else "train"


def _kept_texts(plan: Plan, shard: int) -> Iterator[tuple[dict, str]]:
    """(decided record, text) of the shard's kept documents."""
    decided = read_table(plan.shard_file("decided", shard)).to_pylist()
    texts = read_table(plan.shard_file("ingest", shard), ["text"])["text"].to_pylist()
    for record, text in zip(decided, texts, strict=True):
        if record["status"] == "kept":
            yield record, text


def train_on_sample(plan: Plan, counts: dict[str, dict], val_fraction: float) -> None:
    """Train the tokenizer on the train documents of smallest seeded hash whose text fits
    in tokenizer_sample_chars: reproducible and spread over all shards. Two passes, so
    that memory holds ids and lengths, never the texts: the first picks the sample, the
    second streams its texts (in canonical order) into the trainer."""
    out = plan.path(TOKENIZER_FILE)
    if done(out):
        return
    heap: list[tuple[bytes, int, int]] = []  # (negated priority, doc_id, chars): largest on top
    chars = 0
    for shard in range(plan.shards):
        decided = read_table(plan.shard_file("decided", shard),
                             ["doc_id", "source", "sha256", "status"])
        lengths = read_table(plan.shard_file("ingest", shard), ["chars"])["chars"].to_pylist()
        rows = zip(*(decided[c].to_pylist() for c in decided.column_names), lengths, strict=True)
        for doc_id, source, sha, status, n_chars in rows:
            if status != "kept" or split_of(sha, counts[source], val_fraction) != "train":
                continue
            priority = hashlib.sha256(f"{plan.seed}:{sha}".encode()).digest()
            heapq.heappush(heap, (bytes(255 - b for b in priority), doc_id, n_chars))
            chars += n_chars
            while chars > plan.tokenizer_sample_chars and len(heap) > 1:
                chars -= heapq.heappop(heap)[2]
    tokenizer = train_tokenizer(_texts_of(plan, {doc_id for _, doc_id, _ in heap}),
                                plan.vocab_size, plan.chat_tokens)
    write_text(out, tokenizer.to_str())


def _texts_of(plan: Plan, chosen: set[int]) -> Iterator[str]:
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("ingest", shard), ["doc_id", "text"])
        for doc_id, text in zip(table["doc_id"].to_pylist(), table["text"].to_pylist(),
                                strict=True):
            if doc_id in chosen:
                yield text


def tokenize(plan: Plan, shard: int, counts: dict[str, dict], val_fraction: float) -> None:
    """Split and encode the shard's kept documents; write its tokens and manifest."""
    tokens_out, manifest_out = plan.shard_file("tokens", shard), plan.shard_file("manifest", shard)
    if done(tokens_out, manifest_out):
        return
    tokenizer = _tokenizer(plan.path(TOKENIZER_FILE).read_text())
    eos = np.array([tokenizer.token_to_id(EOS)], np.uint32)
    kept = list(_kept_texts(plan, shard))
    encoded: dict[int, tuple[str, np.ndarray]] = {}
    for chunk in _chunks_of_chars(kept, ENCODE_CHARS):
        encodings = tokenizer.encode_batch_fast([text for _, text in chunk])
        for (record, _), encoding in zip(chunk, encodings, strict=True):
            split = split_of(record["sha256"], counts[record["source"]], val_fraction)
            encoded[record["doc_id"]] = (split, np.append(np.array(encoding.ids, np.uint32),
                                                          eos))
        del encodings
    arrays = [encoded[r["doc_id"]][1] for r, _ in kept]
    offsets = np.cumsum([0, *map(len, arrays)]).astype(np.int32)
    tokens = pa.table({
        "doc_id": pa.array([r["doc_id"] for r, _ in kept], pa.int64()),
        "source": pa.array([r["source"] for r, _ in kept], pa.string()),
        "split": pa.array([encoded[r["doc_id"]][0] for r, _ in kept], pa.string()),
        "ids": pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(np.concatenate([np.zeros(0, np.uint32), *arrays]))),
    }, schema=TOKENS)
    write_table(tokens_out, tokens)
    records = read_table(plan.shard_file("decided", shard)).to_pylist()
    for record in records:
        split, ids = encoded.get(record["doc_id"], ("", []))
        record["split"], record["tokens"] = split, len(ids)
    write_table(manifest_out, pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA))


@lru_cache(maxsize=1)
def _tokenizer(json_text: str) -> Tokenizer:
    """One tokenizer per process and tokenizer file. `tokenizers` keeps a few MB of every
    tokenizer loaded, even once dropped (measured: +3-5 MB RSS per load and encode), so a
    pool worker loading one per task grew with the number of shards."""
    return Tokenizer.from_str(json_text)


def _chunks_of_chars(docs: list[tuple[dict, str]],
                     chars: int) -> Iterator[list[tuple[dict, str]]]:
    """Consecutive runs of (record, text) of at most `chars` characters (a longer text
    alone)."""
    chunk: list[tuple[dict, str]] = []
    size = 0
    for doc in docs:
        if chunk and size + len(doc[1]) > chars:
            yield chunk
            chunk, size = [], 0
        chunk.append(doc)
        size += len(doc[1])
    if chunk:
        yield chunk


def stream_pieces(plan: Plan, dtype: np.dtype) -> Iterator[tuple[tuple[str, str], np.ndarray]]:
    """((source, split), tokens) of every stream in one pass over the token shards:
    shard by shard, each shard's documents of a stream in canonical order."""
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("tokens", shard))
        streams = zip(table["source"].to_pylist(), table["split"].to_pylist(), strict=True)
        for source, split in dict.fromkeys(streams):
            mine = table.filter(pc.and_(pc.equal(table["source"], source),
                                        pc.equal(table["split"], split)))
            yield (source, split), pc.list_flatten(mine["ids"]).to_numpy().astype(dtype)


def tasks(plan: Plan, stage: str, **kwargs: object) -> list[Task]:
    """The stage's tasks: one per shard, or one per hash partition."""
    by_shard = {"ingest": ingest, "band": band, "decide": decide, "tokenize": tokenize}
    by_part = {"exact": exact_dedup, "pair": pair}
    if stage in by_shard:
        return [partial(by_shard[stage], plan, s, **kwargs) for s in range(plan.shards)]
    return [partial(by_part[stage], plan, p, **kwargs) for p in range(plan.partitions)]


def plan_fingerprint(plan: Plan, settings: dict, listing_digest: str) -> str:
    """Stage outputs belong to one (settings, file list): a rerun with others starts over."""
    fields = {**settings, "plan": {k: v for k, v in plan.__dict__.items() if k != "work"},
              "listing": listing_digest}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
