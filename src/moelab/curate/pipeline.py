"""`moelab data curate DIR`: embed, cluster and bucket a prepared dataset into cells.

Opt-in and after `prepare`: the dataset's source streams, tokenizer and manifest are left
as they were (so `moelab train`'s default corpus is unchanged); curation adds
DIR/cells/ (one token stream per cell and split, assignments.parquet, report.json) and a
"cells" entry in meta.json. It works on the dataset, not the raw files: a document's
tokens are its slice of its (source, split) stream (the manifest gives the counts in
stream order) and its text is their decoding (the byte-level BPE is lossless), so the
neural embedder sees exactly the ids a model trained on this dataset saw.

Stages, in DIR/.curate like prepare's, a task per manifest shard on the same executors
(local pool or Ray) and with the same rule: a task whose output exists is skipped.

    sample     (driver)  the sample_docs kept documents of smallest seeded hash
    fit        (driver)  lexical only: TF-IDF + SVD on the sample's texts
    embed      per shard embed/part-S        doc_id, unit vector
    kmeans     (driver)  centroids.npy       spherical k-means on the sample's vectors
    assign     per shard assign/part-S       doc_id, fine cluster
    domains    (driver)  fine clusters merged by centroid similarity; quality cuts
    cells      per shard cells/part-S        doc_id, domain, bucket, quality, tokens
    write      (driver)  cell streams, assignments, report, meta.json

Memory: a shard task holds one shard's documents and vectors; the driver holds the
sample (ids, vectors, texts for the report), the centroids, and the assignment table it
writes (ids, labels, counts and path: ~100-200 bytes a document, ~1 GB at 10M documents;
past that it would have to be written shard by shard).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moelab.curate import embed
from moelab.data import cells as cellmod
from moelab.data import cluster
from moelab.data.executor import Executor, RayExecutor
from moelab.data.loader import META_FILE, SPLITS, read_meta
from moelab.data.provenance import manifest_shards
from moelab.data.shards import read_table, shard_path, write_json, write_streams, write_table
from moelab.data.tokenizer import EOS
from moelab.errors import UserError

WORK_DIR = ".curate"
TEXT_CHARS = 20_000  # characters of a document the lexical embedder reads: its topic shows
SNIPPET_CHARS = 160
CELL_TABLE = pa.schema([
    ("doc_id", pa.int64()), ("source", pa.string()), ("split", pa.string()),
    ("path", pa.string()), ("tokens", pa.int64()), ("fine", pa.int64()),
    ("domain", pa.int64()), ("bucket", pa.int64()), ("quality", pa.float64()),
])


@dataclass(frozen=True)
class CuratePlan:
    """Everything a curation task needs; small and picklable."""

    data_dir: str
    embedder: str  # one of embed.EMBEDDERS
    checkpoint: str | None  # the neural embedder's run directory
    dim: int  # lexical dimensions (neural: the model's d_model)
    clusters: int  # K fine clusters
    domains: int  # fine clusters merged into this many domains
    buckets: int  # quality buckets
    sample_docs: int  # seeded sample for the lexical fit, k-means and quality cuts
    min_cell_fraction: float  # cells with fewer train tokens go to the tail
    seed: int
    offsets: tuple  # per manifest shard: {"source/split": first token in its stream}

    @property
    def shards(self) -> int:
        return len(self.offsets)

    def path(self, *parts: str) -> Path:
        return Path(self.data_dir, WORK_DIR, *parts)

    def shard_file(self, stage: str, shard: int) -> Path:
        return self.path(stage, f"part-{shard:05d}.parquet")


def curate(data_dir: str | Path, embedder: str = "lexical", checkpoint: str | Path | None = None,
           dim: int = embed.LEXICAL_DIM, clusters: int = 64, domains: int = 8, buckets: int = 5,
           sample_docs: int = 10_000, min_cell_fraction: float = 0.01, seed: int = 0,
           workers: int | None = None, use_ray: bool = False) -> dict:
    """Curate a prepared dataset in place; return meta.json's new "cells" entry (its
    report has the figures; "peak_rss_mb" has the largest task peak per stage, "seconds"
    each stage's wall time)."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    _check(embedder, checkpoint, clusters, domains, buckets, sample_docs, min_cell_fraction)
    if embedder == "neural":
        embed.check_checkpoint(Path(checkpoint), data_dir)
    plan = CuratePlan(str(data_dir), embedder, None if checkpoint is None else str(checkpoint),
                      dim, clusters, domains, buckets, sample_docs, min_cell_fraction, seed,
                      tuple(_stream_offsets(data_dir)))
    _start_work(plan)
    with RayExecutor() if use_ray else Executor(workers) as executor:
        with executor.timed("sample"):
            sample = sample_ids(plan)
        if not sample:
            raise UserError(f"{data_dir} has no kept document with tokens to curate")
        cluster.check_k(clusters, len(sample))  # before the embedding work, not after it
        if embedder == "lexical" and not plan.path(embed.LEXICAL_FILE).exists():
            with executor.timed("fit_lexical"):
                embed.fit_lexical((_lexical_text(t) for _, t in _sample_texts(plan, sample)),
                                  dim, seed, plan.path(embed.LEXICAL_FILE))
        executor.map(tasks(plan, "embed"), "embed")
        with executor.timed("fit_centroids"):
            vectors, sample_order = _sample_vectors(plan, sample)
            centroids_file = plan.path("centroids.npy")
            if not centroids_file.exists():
                np.save(centroids_file, cluster.fit_centroids(vectors, clusters, seed))
            centroids = np.load(centroids_file)
        executor.map(tasks(plan, "assign"), "assign")
        with executor.timed("merge_and_cut"):
            fine_sizes = np.zeros(len(centroids), np.int64)
            for shard in range(plan.shards):
                fine = read_table(plan.shard_file("assign", shard), ["fine"])["fine"].to_numpy()
                fine_sizes += np.bincount(fine, minlength=len(centroids))
            domain_of = cluster.merge_to_domains(centroids, fine_sizes, domains)
            qualities = _sample_qualities(plan, sample)
            ref = cellmod.reference(qualities.values())
            sample_q = np.array([cellmod.composite(qualities[i], ref) for i in sample_order])
            cut_points = cellmod.cuts(sample_q, buckets)
        executor.map(tasks(plan, "cells", domain_of=domain_of.tolist(), ref=ref,
                           cut_points=cut_points), "cells")
        with executor.timed("report"):
            entry = write_cells(plan, meta, centroids, domain_of, cut_points, sample,
                                vectors, sample_order)
        entry["peak_rss_mb"] = dict(executor.peak_rss_mb)
        entry["seconds"] = dict(executor.seconds)  # wall seconds by stage, driver work too
    shutil.rmtree(plan.path())
    return entry


def _check(embedder: str, checkpoint: object, clusters: int, domains: int, buckets: int,
           sample_docs: int, min_cell_fraction: float) -> None:
    if embedder not in embed.EMBEDDERS:
        raise UserError(f"--embedder must be one of {embed.EMBEDDERS}, got {embedder!r}")
    if (embedder == "neural") != (checkpoint is not None):
        raise UserError("--embedder neural needs --checkpoint RUN_DIR (a run trained on this "
                        "dataset), and only it takes one")
    if min(clusters, domains, buckets, sample_docs) < 1:
        raise UserError("--clusters, --domains, --buckets and --sample-docs must be >= 1")
    if not 0 <= min_cell_fraction < 1:
        raise UserError(f"--min-cell-fraction must be in [0, 1), got {min_cell_fraction}")


def _start_work(plan: CuratePlan) -> None:
    """Keep an interrupted curation's outputs when its plan is the same, else start over."""
    fingerprint = hashlib.sha256(json.dumps(asdict(plan), sort_keys=True,
                                            default=str).encode()).hexdigest()
    plan_file = plan.path("plan.json")
    if plan_file.is_file() and json.loads(plan_file.read_text())["fingerprint"] != fingerprint:
        shutil.rmtree(plan.path())
    plan.path().mkdir(parents=True, exist_ok=True)
    write_json(plan_file, {"fingerprint": fingerprint})


def _stream_offsets(data_dir: Path) -> Iterator[dict[str, int]]:
    """Per manifest shard, where its documents start in each (source, split) stream:
    prepare packs a stream's documents in manifest order, each followed by EOS (which the
    manifest's token count includes)."""
    position: Counter = Counter()
    for path in manifest_shards(data_dir):
        yield dict(position)
        table = read_table(path, ["source", "split", "tokens"])
        for source, split, tokens in zip(*(table[c].to_pylist() for c in table.column_names),
                                         strict=True):
            if split:
                position[f"{source}/{split}"] += tokens


def shard_docs(plan: CuratePlan, shard: int, eos: bool = False) -> Iterator[dict]:
    """The shard's kept documents with tokens: the manifest record (doc_id, source, split,
    sha256, path, tokens) and "ids", its tokens (without the final EOS unless `eos`)."""
    path = manifest_shards(plan.data_dir)[shard]
    table = read_table(path, ["doc_id", "source", "split", "sha256", "path", "tokens"])
    position = dict(plan.offsets[shard])
    streams: dict[str, np.ndarray] = {}
    for record in table.to_pylist():
        if not record["split"]:
            continue
        key = f"{record['source']}/{record['split']}"
        start = position.get(key, 0)
        position[key] = start + record["tokens"]
        if key not in streams:
            streams[key] = np.load(shard_path(plan.data_dir, record["source"], record["split"]),
                                   mmap_mode="r")
        record["ids"] = np.asarray(streams[key][start : start + record["tokens"] - (not eos)])
        yield record


@lru_cache(maxsize=1)
def _tokenizer(data_dir: str):
    from moelab.data.tokenizer import load_tokenizer

    return load_tokenizer(data_dir)  # a damaged tokenizer.json: one line naming it


def text_of(plan: CuratePlan, ids: np.ndarray) -> str:
    return _tokenizer(plan.data_dir).decode(ids.tolist(), skip_special_tokens=False)


def _lexical_text(text: str) -> str:
    return text[:TEXT_CHARS]


def _priority(seed: int, sha: str) -> bytes:
    return hashlib.sha256(f"{seed}:{sha}".encode()).digest()


def sample_ids(plan: CuratePlan) -> set[int]:
    """The sample_docs documents (both splits) of smallest seeded content hash: spread over
    every shard, the same whatever the sharding, held as ids only."""
    heap: list[tuple[bytes, int]] = []  # (negated priority, doc_id): the largest on top
    for path in manifest_shards(plan.data_dir):
        table = read_table(path, ["doc_id", "sha256", "split"])
        for doc_id, sha, split in zip(*(table[c].to_pylist() for c in table.column_names),
                                      strict=True):
            if not split:
                continue
            item = (bytes(255 - b for b in _priority(plan.seed, sha)), doc_id)
            if len(heap) < plan.sample_docs:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    return {doc_id for _, doc_id in heap}


def _sample_texts(plan: CuratePlan, sample: set[int]) -> Iterator[tuple[int, str]]:
    for shard in range(plan.shards):
        for record in shard_docs(plan, shard):
            if record["doc_id"] in sample:
                yield record["doc_id"], text_of(plan, record["ids"])


def _sample_vectors(plan: CuratePlan, sample: set[int]) -> tuple[np.ndarray, list[int]]:
    """The sample's vectors [n, d] and their doc ids, in doc_id order."""
    wanted = pa.array(sorted(sample), pa.int64())
    parts, ids = [], []
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("embed", shard))
        table = table.filter(pc.is_in(table["doc_id"], wanted))
        if table.num_rows:
            ids += table["doc_id"].to_pylist()
            parts.append(_vectors(table))
    return np.concatenate(parts), ids


def _vectors(table: pa.Table) -> np.ndarray:
    column = table["vector"].combine_chunks()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def _sample_qualities(plan: CuratePlan, sample: set[int]) -> dict[int, dict]:
    found = {}
    for path in manifest_shards(plan.data_dir):
        table = read_table(path, ["doc_id", "quality"])
        for doc_id, scores in zip(table["doc_id"].to_pylist(), table["quality"].to_pylist(),
                                  strict=True):
            if doc_id in sample:
                found[doc_id] = scores or {}
    return found


# ---------------------------------------------------------------------------- tasks


def embed_shard(plan: CuratePlan, shard: int) -> int:
    out = plan.shard_file("embed", shard)
    if out.exists():
        return 0
    docs = list(shard_docs(plan, shard))
    if not docs:  # every document dropped: an empty table (its width is never read)
        vectors = np.zeros((0, 1), np.float32)
    elif plan.embedder == "lexical":
        vectors = embed.embed_lexical([_lexical_text(text_of(plan, d["ids"])) for d in docs],
                                      plan.path(embed.LEXICAL_FILE))
    else:
        eos = _tokenizer(plan.data_dir).token_to_id(EOS)
        vectors = embed.embed_neural([d["ids"] for d in docs], Path(plan.checkpoint), eos)
    width = vectors.shape[1]
    flat = pa.array(vectors.reshape(-1).astype(np.float32), pa.float32())
    write_table(out, pa.table({
        "doc_id": pa.array([d["doc_id"] for d in docs], pa.int64()),
        "vector": pa.FixedSizeListArray.from_arrays(flat, width)}))
    return len(docs)


def assign_shard(plan: CuratePlan, shard: int) -> int:
    out = plan.shard_file("assign", shard)
    if out.exists():
        return 0
    table = read_table(plan.shard_file("embed", shard))
    fine = cluster.assign(_vectors(table) if table.num_rows else np.zeros((0, 1), np.float32),
                          np.load(plan.path("centroids.npy")))
    write_table(out, pa.table({"doc_id": table["doc_id"], "fine": pa.array(fine, pa.int64())}))
    return table.num_rows


def cells_shard(plan: CuratePlan, shard: int, domain_of: list[int], ref: dict,
                cut_points: list[float]) -> int:
    out = plan.shard_file("cells", shard)
    if out.exists():
        return 0
    fine = dict(zip(*(read_table(plan.shard_file("assign", shard))[c].to_pylist()
                      for c in ("doc_id", "fine")), strict=True))
    path = manifest_shards(plan.data_dir)[shard]
    table = read_table(path, ["doc_id", "source", "split", "path", "tokens", "quality"])
    rows = []
    for record in table.to_pylist():
        if record["doc_id"] not in fine:
            continue
        quality = cellmod.composite(record.pop("quality") or {}, ref)
        f = fine[record["doc_id"]]
        rows.append({**record, "fine": f, "domain": domain_of[f],
                     "bucket": cellmod.bucket(quality, cut_points), "quality": quality})
    write_table(out, pa.Table.from_pylist(rows, schema=CELL_TABLE))
    return len(rows)


def tasks(plan: CuratePlan, stage: str, **kwargs: object) -> list:
    run = {"embed": embed_shard, "assign": assign_shard, "cells": cells_shard}[stage]
    return [partial(run, plan, s, **kwargs) for s in range(plan.shards)]


# ---------------------------------------------------------------------------- write


def write_cells(plan: CuratePlan, meta: dict, centroids: np.ndarray, domain_of: np.ndarray,
                cut_points: list[float], sample: set[int], vectors: np.ndarray,
                sample_order: list[int]) -> dict:
    """Cell streams, the assignment of every document, the report, and meta.json's entry."""
    data_dir = Path(plan.data_dir)
    tables = [read_table(plan.shard_file("cells", s)) for s in range(plan.shards)]
    every = pa.concat_tables(tables)  # small columns only: ids, labels, counts, paths
    raw = [cellmod.cell_name(d, b) for d, b in zip(every["domain"].to_pylist(),
                                                    every["bucket"].to_pylist(), strict=True)]
    train_tokens: Counter = Counter()
    for name, split, tokens in zip(raw, every["split"].to_pylist(), every["tokens"].to_pylist(),
                                   strict=True):
        train_tokens[name] += tokens if split == "train" else 0
    final = cellmod.merge_tiny(dict(train_tokens), plan.min_cell_fraction)
    names = [final[n] for n in raw]
    every = every.append_column("cell", pa.array(names, pa.string()))
    out = data_dir / cellmod.CELLS_DIR
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    write_table(out / cellmod.ASSIGNMENTS_FILE, every)
    dtype = np.dtype(meta["dtype"])
    cell_names = sorted(set(names), key=lambda n: (n == cellmod.TAIL, n))
    totals = Counter()
    for name, split, tokens in zip(names, every["split"].to_pylist(),
                                   every["tokens"].to_pylist(), strict=True):
        totals[name, split] += tokens
    keys = [(c, s) for c in cell_names for s in SPLITS]
    paths = {k: out / f"{cellmod.cell_file_stem(k[0])}.{k[1]}.npy" for k in keys}
    write_streams(paths, {k: totals[k] for k in keys}, _cell_pieces(plan, final), dtype)
    report = cluster_report(plan, every, centroids, domain_of, sample, vectors, sample_order)
    write_json(out / cellmod.REPORT_FILE, report)
    entry = {
        "embedder": plan.embedder, "checkpoint": plan.checkpoint,
        "settings": {k: v for k, v in asdict(plan).items()
                     if k not in ("data_dir", "offsets", "embedder", "checkpoint")},
        "quality_cuts": cut_points,
        "cells": {c: _provenance(every, c, final) for c in cell_names},
        "report": cellmod.REPORT_FILE,
    }
    meta = {**read_meta(data_dir), "cells": entry}
    write_json(data_dir / META_FILE, meta)
    return {**entry, "report": report}


def _provenance(every: pa.Table, name: str, final: dict[str, str]) -> dict:
    """Token counts per split, documents and train tokens per source (what a loss weighted
    by a cell mixture weighs the per-source val splits by), and which domain x bucket cells
    it holds (a tail holds several)."""
    mine = every.filter(pc.equal(every["cell"], name))
    split, tokens = mine["split"].to_pylist(), mine["tokens"].to_pylist()
    train_by_source: Counter = Counter()
    for source, sp, t in zip(mine["source"].to_pylist(), split, tokens, strict=True):
        train_by_source[source] += t if sp == "train" else 0
    return {**{f"{s}_tokens": sum(t for sp, t in zip(split, tokens, strict=True) if sp == s)
               for s in SPLITS},
            "documents": mine.num_rows,
            "sources": dict(sorted(Counter(mine["source"].to_pylist()).items())),
            "source_train_tokens": dict(sorted(train_by_source.items())),
            "members": sorted(c for c, f in final.items() if f == name)}


def _cell_pieces(plan: CuratePlan, final: dict[str, str]) -> Iterator[tuple[tuple, np.ndarray]]:
    """((cell, split), tokens with EOS) of every document, shard by shard in manifest
    order: each cell stream packs its documents as prepare packs a source's."""
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("cells", shard), ["doc_id", "domain", "bucket"])
        cell_of = {i: final[cellmod.cell_name(d, b)] for i, d, b in zip(
            *(table[c].to_pylist() for c in table.column_names), strict=True)}
        for record in shard_docs(plan, shard, eos=True):
            yield (cell_of[record["doc_id"]], record["split"]), record["ids"]


def cluster_report(plan: CuratePlan, every: pa.Table, centroids: np.ndarray,
                   domain_of: np.ndarray, sample: set[int], vectors: np.ndarray,
                   sample_order: list[int]) -> dict:
    """Sizes, largest/smallest ratios, purity, NMI and silhouette against the sources; per
    domain: documents, tokens, its fine clusters, top terms and three sample snippets."""
    fine = every["fine"].to_numpy()
    domains = every["domain"].to_numpy()
    sources = sorted(set(every["source"].to_pylist()))
    source_ids = np.array([sources.index(s) for s in every["source"].to_pylist()], np.int64)
    fine_sizes = np.bincount(fine, minlength=len(centroids))
    n_domains = int(domain_of.max()) + 1
    domain_docs = np.bincount(domains, minlength=n_domains)
    domain_tokens = np.bincount(domains, weights=every["tokens"].to_numpy(), minlength=n_domains)
    texts = dict(_sample_texts(plan, sample))
    by_id = dict(zip(every["doc_id"].to_pylist(), domains.tolist(), strict=True))
    sample_domains = np.array([by_id[i] for i in sample_order])
    terms = cluster.top_terms([texts[i][:TEXT_CHARS] for i in sample_order], sample_domains,
                              n_domains)
    per_domain = []
    for d in range(n_domains):
        mine = source_ids[domains == d]
        majority = np.bincount(mine, minlength=len(sources)) if len(mine) else None
        snippets = [" ".join(texts[i][:SNIPPET_CHARS].split()) for i in sample_order
                    if by_id[i] == d][:3]
        per_domain.append({
            "domain": f"d{d:02d}", "documents": int(domain_docs[d]),
            "tokens": int(domain_tokens[d]),
            "fine_clusters": int((domain_of == d).sum()),
            "majority_source": None if majority is None else sources[int(majority.argmax())],
            "majority_share": None if majority is None else
            round(float(majority.max() / len(mine)), 4),
            "top_terms": terms[d], "snippets": snippets})
    nonempty = fine_sizes[fine_sizes > 0]
    return {
        "embedder": plan.embedder, "documents": int(len(fine)), "sample_docs": len(sample),
        "dim": int(vectors.shape[1]), "fine_clusters": int(len(centroids)),
        "fine_clusters_nonempty": int(len(nonempty)),
        "fine_size_ratio": round(float(nonempty.max() / nonempty.min()), 2),
        "domains": n_domains,
        "domain_size_ratio": round(float(domain_docs.max() / max(domain_docs.min(), 1)), 2),
        **cluster.label_agreement(domains, source_ids),
        "silhouette_domains": cluster.silhouette(vectors, sample_domains, plan.seed),
        "per_domain": per_domain,
    }
