"""`prepare` at scale: memory and throughput at 1x/4x/16x, local vs Ray, vs datatrove.

    python3 bench/data_throughput.py [--docs 500] [--scales 1,4,16] [--workers 2]
                                     [--no-ray] [--no-datatrove]

Corpus: the `installed` preset (every installed package's Python sources + system docs),
`--docs` documents per source at 1x; a larger scale is a superset (files are sampled by
path hash). Each prepare runs in a fresh process; its peak RSS is read per stage (prepare's
own probe: the driver's high-water mark per phase and the largest of any task per stage,
each reset when its phase or task starts), so growth is located by stage, and sampled over
the whole process tree (bench/rss.py: the driver and its workers together, every 0.2 s; not
/usr/bin/time, whose high-water mark the probe's clear_refs resets). The tokenizer
sample is capped below the 1x text (--tokenizer-chars) so every scale trains on the same
amount: that cap is what bounds the tokenizer's memory. Then, on the 1x input: the Ray
executor (a local runtime, num_cpus = workers) against the local one; on the largest
input, datatrove's MinHash pipeline against moelab's near-dup stages with the same n-grams
and bands, single process each. Writes bench/results/benchmarks/data_throughput.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model, settle  # bench/machine.py
from rss import Sampler, run_sampled  # bench/rss.py

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "data_throughput.json"
DEDUP_PHASES = ("exact", "merge_exact", "band", "pair", "cluster", "decide")

CHILD = """
import json, sys, time
settings = json.loads(sys.argv[1])
if settings.pop("ray", False):
    import ray
    start = time.perf_counter()
    ray.init(num_cpus=settings["workers"], include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    settings["use_ray"], ray_init = True, time.perf_counter() - start
else:
    ray_init = None
from moelab.data.prepare import DEFAULT_MAX_CHARS, SOURCE_PRESETS, prepare
preset = settings.pop("preset")
start = time.perf_counter()
meta = prepare(settings.pop("out"), SOURCE_PRESETS[preset], max_chars=DEFAULT_MAX_CHARS,
               **settings)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "phases": meta["seconds"], "documents": meta["documents"],
                  "tokens": sum(sum(meta[f"{s}_tokens"].values()) for s in ("train", "val")),
                  "rss_by_stage_mb": meta["peak_rss_mb"], "ray_init_seconds": ray_init}))
"""


def run_prepare(out: Path, **settings: object) -> dict:
    """One prepare in a fresh process; its seconds, documents and peak RSS (per stage from
    prepare's probe, and sampled over the process tree)."""
    stdout, sampled = run_sampled([sys.executable, "-c", CHILD,
                                   json.dumps({"out": str(out), **settings})])
    result = json.loads(stdout.strip().splitlines()[-1])
    result["sampled"] = sampled
    docs = sum(c["docs"] for c in result["documents"].values())
    # stages: without "list", the preset's globbing of the whole filesystem, whatever the
    # sample size (~20 s for `installed`), and without the process's imports
    stage_seconds = sum(v for k, v in result["phases"].items() if k != "list")
    by_stage = result["rss_by_stage_mb"]
    result.update(docs=docs, docs_per_s=round(docs / result["seconds"], 1),
                  docs_per_s_stages=round(docs / stage_seconds, 1),
                  peak_rss_mb={"driver": max(by_stage["driver"].values()),
                               "worker": max(by_stage["tasks"].values())})
    return result


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def scale_runs(tmp: Path, args: argparse.Namespace) -> dict:
    runs = {}
    for scale in args.scales:
        result = run_prepare(tmp / f"x{scale}", preset="installed",
                             max_docs_per_source=args.docs * scale, workers=args.workers,
                             tokenizer_sample_chars=args.tokenizer_chars)
        runs[f"{scale}x"] = result
        print(f"{scale:>3}x: {result['docs']} docs in {result['seconds']:.1f} s, "
              f"{result['docs_per_s']} docs/s ({result['docs_per_s_stages']} in the stages), "
              f"peak RSS driver {result['peak_rss_mb']['driver']} MB, largest worker "
              f"{result['peak_rss_mb']['worker']} MB; sampled: tree "
              f"{result['sampled']['peak_rss_mb_tree']} MB, one process "
              f"{result['sampled']['peak_rss_mb_one_process']} MB", flush=True)
    first, last = runs[f"{args.scales[0]}x"], runs[f"{args.scales[-1]}x"]

    def peak(r: dict) -> int:
        return r["peak_rss_mb"]["driver"] + args.workers * r["peak_rss_mb"]["worker"]

    return {"runs": runs,
            "rss_ratio_largest_process": round(
                max(last["peak_rss_mb"].values()) / max(first["peak_rss_mb"].values()), 3),
            "rss_ratio_driver_plus_workers": round(peak(last) / peak(first), 3),
            "rss_ratio_tree_sampled": round(last["sampled"]["peak_rss_mb_tree"]
                                            / first["sampled"]["peak_rss_mb_tree"], 3),
            "docs_per_s_ratio": round(last["docs_per_s"] / first["docs_per_s"], 3),
            "docs_per_s_stages_ratio": round(
                last["docs_per_s_stages"] / first["docs_per_s_stages"], 3)}


def ray_vs_local(tmp: Path, args: argparse.Namespace, local: dict) -> dict:
    """The 1x prepare again on Ray; its output against the local 1x run's."""
    ray = run_prepare(tmp / "ray1x", preset="installed", max_docs_per_source=args.docs,
                      workers=args.workers, tokenizer_sample_chars=args.tokenizer_chars,
                      ray=True)
    identical = tree_bytes(tmp / "x1") == tree_bytes(tmp / "ray1x")
    print(f"local {local['seconds']:.1f} s vs ray {ray['seconds']:.1f} s (+ init "
          f"{ray['ray_init_seconds']:.1f} s); byte-identical: {identical}", flush=True)
    return {"local_seconds": round(local["seconds"], 2), "ray_seconds": round(ray["seconds"], 2),
            "ray_init_seconds": round(ray["ray_init_seconds"], 2),
            "byte_identical": identical, "docs": local["docs"]}


# ------------------------------------------------------------------------ datatrove


def near_dup_input(data_dir: Path) -> list[tuple[str, str]]:
    """(path, normalized text) of the documents moelab's near-dup stage saw, in order:
    kept ones and near duplicates (they passed every other filter)."""
    from moelab.data.ingest import Document, process_document
    from moelab.data.provenance import locator, read_manifest, span_of
    from moelab.data.quality import SCORES

    off = {name: (None, None) for name in SCORES}
    docs = []
    for record in read_manifest(data_dir):
        if record["status"] == "kept" or record["reason"].startswith("near_dup_of:"):
            doc = process_document(Document(record["source"], record["path"],
                                            span=span_of(record)), min_chars=1, thresholds=off)
            docs.append((locator(record["path"], span_of(record)), doc.text))
    return docs


def moelab_near_dups(tmp: Path, docs: list[tuple[str, str]]) -> dict:
    """moelab on the same texts (one file each, names keep the order), one process."""
    from moelab.data import dedup
    from moelab.data.prepare import prepare
    from moelab.data.provenance import read_manifest
    from moelab.data.quality import SCORES

    src = tmp / "texts"
    src.mkdir()
    for i, (_, text) in enumerate(docs):
        (src / f"{i:06d}.txt").write_text(text)
    start = time.perf_counter()
    for _, text in docs:
        dedup.signature(text)
    signing = time.perf_counter() - start
    meta = prepare(tmp / "moelab_nd", {"docs": str(src / "*.txt")}, min_chars=1, workers=1,
                   quality_thresholds={name: [None, None] for name in SCORES}, vocab_size=300)
    partner = {}
    for record in read_manifest(tmp / "moelab_nd"):
        if record["reason"].startswith("near_dup_of:"):
            index = int(Path(record["path"]).stem)
            partner[docs[index][0]] = docs[int(Path(record["reason"][12:]).stem)][0]
    seconds = signing + sum(meta["seconds"][phase] for phase in DEDUP_PHASES)
    return {"removed": partner, "seconds": round(seconds, 2),
            "docs_per_s": round(len(docs) / seconds, 1),
            "bands": meta["settings"]["minhash"]["bands"],
            "rows": meta["settings"]["minhash"]["rows"]}


def datatrove_near_dups(tmp: Path, docs: list[tuple[str, str]], bands: int, rows: int) -> dict:
    """datatrove's 4 MinHash stages (signatures, buckets, clusters, filter), one worker."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers.jsonl import JsonlWriter
    from datatrove.utils.hashing import HashConfig
    from loguru import logger

    logger.remove()  # datatrove logs every stage's stats table to stderr
    logger.add(sys.stderr, level="WARNING")

    root = tmp / "datatrove"
    (root / "input").mkdir(parents=True)
    with open(root / "input" / "docs.jsonl", "w") as file:
        for path, text in docs:
            file.write(json.dumps({"id": path, "text": text}) + "\n")
    config = MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows,
                           hash_config=HashConfig(precision=32))

    def reader() -> JsonlReader:
        return JsonlReader(str(root / "input"))

    stages = [
        ([reader(), MinhashDedupSignature(str(root / "sigs"), config=config)], 1),
        ([MinhashDedupBuckets(str(root / "sigs"), str(root / "buckets"), config=config)], bands),
        ([MinhashDedupCluster(str(root / "buckets"), str(root / "remove"), config=config,
                              save_cluster_id=True)], 1),
        ([reader(), MinhashDedupFilter(str(root / "remove"), load_cluster_ids=True,
                                       exclusion_writer=JsonlWriter(str(root / "removed"))),
          JsonlWriter(str(root / "kept"))], 1),
    ]
    start = time.perf_counter()
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1,
                              logging_dir=str(root / f"logs{i}")).run()
    seconds = time.perf_counter() - start
    clusters: dict[str, int] = {}
    removed, kept_in_cluster = set(), {}
    for folder in ("removed", "kept"):
        for part in (root / folder).glob("*.jsonl.gz"):
            for line in gzip.open(part, "rt"):
                doc = json.loads(line)
                cluster = doc["metadata"].get("minhash_cluster_id", -1)
                if cluster != -1:
                    clusters[doc["id"]] = cluster
                    if folder == "kept":
                        kept_in_cluster[cluster] = doc["id"]
                if folder == "removed":
                    removed.add(doc["id"])
    partner = {path: kept_in_cluster.get(clusters.get(path, -1), "") for path in removed}
    return {"removed": partner, "seconds": round(seconds, 2),
            "docs_per_s": round(len(docs) / seconds, 1)}


def shingle_jaccard(a: str, b: str, simplify: bool) -> float:
    """Exact Jaccard of word 5-gram sets: moelab's words (lower-cased, split on blanks),
    or datatrove's simplified text (punctuation and digits normalized away)."""
    from datatrove.utils.text import simplify_text

    def shingles(text: str) -> set:
        words = (simplify_text(text) if simplify else text.lower()).split()
        return {tuple(words[i : i + 5]) for i in range(max(1, len(words) - 4))}

    sa, sb = shingles(a), shingles(b)
    return round(len(sa & sb) / max(1, len(sa | sb)), 3)


def versus_datatrove(tmp: Path, args: argparse.Namespace) -> dict:
    docs = near_dup_input(tmp / f"x{args.scales[-1]}")  # the most near duplicates
    ours = moelab_near_dups(tmp, docs)
    theirs = datatrove_near_dups(tmp, docs, ours["bands"], ours["rows"])
    a, b = set(ours["removed"]), set(theirs["removed"])
    text = dict(docs)
    examples = []
    for who, only, partners in (("moelab", a - b, ours["removed"]),
                                ("datatrove", b - a, theirs["removed"])):
        for path in sorted(only)[: args.examples]:
            other = partners[path]
            examples.append({
                "removed_only_by": who, "path": path, "duplicate_of": other,
                "jaccard_words": shingle_jaccard(text[path], text[other], False) if other else None,
                "jaccard_simplified": shingle_jaccard(text[path], text[other], True)
                if other else None})
    result = {"docs": len(docs), "bands": ours["bands"], "rows": ours["rows"], "n_grams": 5,
              "moelab_seconds": ours["seconds"], "moelab_docs_per_s": ours["docs_per_s"],
              "datatrove_seconds": theirs["seconds"],
              "datatrove_docs_per_s": theirs["docs_per_s"],
              "removed_moelab": len(a), "removed_datatrove": len(b), "removed_both": len(a & b),
              # two empty sets agree: nothing to remove, both removed nothing
              "jaccard_of_removed_sets": round(len(a & b) / len(a | b), 3) if a | b else 1.0,
              "disagreements": examples}
    print(f"near dups on {len(docs)} docs: moelab removes {len(a)} ({ours['docs_per_s']} docs/s),"
          f" datatrove {len(b)} ({theirs['docs_per_s']} docs/s); Jaccard of the removed sets "
          f"{result['jaccard_of_removed_sets']}", flush=True)
    for example in examples:
        print("  ", example)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=500, help="documents per source at 1x")
    parser.add_argument("--scales", default="1,4,16")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--tokenizer-chars", type=int, default=2_000_000,
                        help="tokenizer sample cap (below the 1x text, see the docstring)")
    parser.add_argument("--examples", type=int, default=3, help="disagreements shown per side")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON to write")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--no-datatrove", action="store_true")
    args = parser.parse_args()
    args.scales = [int(s) for s in args.scales.split(",")]
    if args.scales[0] != 1:
        parser.error("--scales must start at 1 (Ray runs on the 1x input)")
    load, waited = settle()  # a quiet machine: these are seconds, not only memory
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result: dict = {"docs_per_source_1x": args.docs, "workers": args.workers,
                    "cpu": cpu_model(), "code_commit": commit or None,
                    "load_per_core_before": round(load, 2), "waited_for_quiet_s": waited,
                    "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                    "python": platform.python_version(),
                    "tokenizer_sample_chars": args.tokenizer_chars}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        result["scale"] = scale_runs(tmp, args)
        if not args.no_ray:
            result["ray_vs_local"] = ray_vs_local(tmp, args, result["scale"]["runs"]["1x"])
        if not args.no_datatrove:
            with (sampler := Sampler()).running():  # in this process: both near-dup runs
                result["datatrove"] = versus_datatrove(tmp, args)
            result["datatrove"]["sampled"] = sampler.figures()
    result["load_average_at_end"] = os.getloadavg()
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    scale = result["scale"]
    print(f"RSS ratio {args.scales[-1]}x/{args.scales[0]}x: largest process "
          f"{scale['rss_ratio_largest_process']}, driver + workers "
          f"{scale['rss_ratio_driver_plus_workers']}; docs/s ratio {scale['docs_per_s_ratio']}"
          f" (stages only {scale['docs_per_s_stages_ratio']})")


if __name__ == "__main__":
    main()
