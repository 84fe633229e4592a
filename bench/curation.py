"""Curation at scale: prepare `--sources installed` (whole, or capped in documents per
source), curate it with both embedders; figures -> bench/results/curation/curation.json.

Peak RSS is sampled (bench/rss.py: every 0.2 s, the RSS of this process plus its children
summed, and the largest single process), not read from /usr/bin/time: the executor resets
each worker's high-water mark between tasks (clear_refs), so a process's VmHWM is not its
lifetime peak.
Seconds are wall time on whatever else the machine is running: documents/s are a rate on
that machine that day, not a speed claim.

    python bench/curation.py --out runs/curation                  # the whole corpus
    python bench/curation.py --max-docs 2000 --out runs/curation  # 2,000 files per source
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rss import Sampler  # bench/rss.py

RESULTS = Path(__file__).parent / "results" / "curation" / "curation.json"


def measured(name: str, results: dict, fn, *args, **kwargs):
    sampler = Sampler()
    start = time.perf_counter()
    with sampler.running():
        out = fn(*args, **kwargs)
    results.setdefault("phases", {})[name] = {
        "seconds": round(time.perf_counter() - start, 1), **sampler.figures()}
    return out


def figures(entry: dict, seconds: float) -> dict:
    report = entry["report"]
    keep = ("documents", "sample_docs", "dim", "fine_clusters", "fine_clusters_nonempty",
            "fine_size_ratio", "domains", "domain_size_ratio", "purity", "nmi",
            "silhouette_domains")
    stages = entry["seconds"]
    return {**{k: report[k] for k in keep}, "docs_per_s": round(report["documents"] / seconds, 1),
            "stage_seconds": stages,
            # the sharded stages' rates; the others are driver work on the sample
            "stage_docs_per_s": {s: round(report["documents"] / stages[s], 1)
                                 for s in ("embed", "assign", "cells") if stages.get(s)},
            "cells": {c: {k: v[k] for k in ("train_tokens", "documents", "sources")}
                      for c, v in entry["cells"].items()},
            "per_domain": [{k: d[k] for k in ("domain", "documents", "majority_source",
                                              "majority_share", "top_terms", "snippets")}
                           for d in report["per_domain"]],
            "task_peak_rss_mb": entry["peak_rss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/curation")
    parser.add_argument("--max-docs", type=int, default=0,
                        help="files per source (0: every installed file)")
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument("--domains", type=int, default=8)
    parser.add_argument("--buckets", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--embedder-steps", type=int, default=200,
                        help="steps of the tiny model the neural embedder uses")
    parser.add_argument("--mix-proxies", type=int, default=32,
                        help="proxy runs of the mixture search over the lexical cells")
    parser.add_argument("--mix-steps", type=int, default=300,
                        help="steps of each proxy and validation run (the tiny preset's)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["prepare", "lexical", "neural", "mix", "mix_trust"],
                        help="phases to skip (their figures stay as the last run left them)")
    args = parser.parse_args()
    from moelab.curate.pipeline import curate
    from moelab.data.prepare import INSTALLED_SOURCES, prepare

    out = Path(args.out)
    data = out / "installed"
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    max_docs = args.max_docs or None
    if "prepare" not in args.skip:
        results["corpus"] = {"sources": "installed", "max_docs_per_source": max_docs}
        shutil.rmtree(data, ignore_errors=True)
        meta = measured("prepare", results, prepare, data, INSTALLED_SOURCES,
                        max_docs_per_source=max_docs, max_chars=1_000_000,
                        workers=args.workers)
        results["corpus"]["train_tokens"] = meta["train_tokens"]
        results["corpus"]["documents"] = {source: {k: counts.get(k, 0) for k in ("docs", "kept")}
                                          for source, counts in meta["documents"].items()}
        docs = sum(counts["docs"] for counts in meta["documents"].values())
        results["phases"]["prepare"]["stage_seconds"] = meta["seconds"]
        results["phases"]["prepare"]["stage_docs_per_s"] = {
            stage: round(docs / s, 1) for stage, s in meta["seconds"].items() if s > 0}
        results["phases"]["prepare"]["task_peak_rss_mb"] = meta["peak_rss_mb"]["tasks"]
        for stale in ("mix_search", "mix_search_cells"):  # measured on another corpus
            results.pop(stale, None)
    settings = dict(clusters=args.clusters, domains=args.domains, buckets=args.buckets,
                    workers=args.workers)
    if "lexical" not in args.skip:
        lexical = out / "lexical"
        shutil.rmtree(lexical, ignore_errors=True)
        shutil.copytree(data, lexical)
        entry = measured("curate_lexical", results, curate, lexical, "lexical", **settings)
        results["lexical"] = figures(entry, results["phases"]["curate_lexical"]["seconds"])
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    if "neural" not in args.skip:
        run = out / "embedder_run"
        shutil.rmtree(run, ignore_errors=True)
        cmd = [sys.executable, "-m", "moelab.cli", "train", "--config", "tiny", "--run-dir",
               str(run), "--set", f"data.path={data.resolve()}", "--set",
               f"train.steps={args.embedder_steps}", "--set", "train.eval_every=1000000"]
        measured("train_embedder", results, subprocess.run, cmd, check=True,
                 capture_output=True)
        neural = out / "neural"
        shutil.rmtree(neural, ignore_errors=True)
        shutil.copytree(data, neural)
        entry = measured("curate_neural", results, curate, neural, "neural", run, **settings)
        results["neural"] = figures(entry, results["phases"]["curate_neural"]["seconds"])
        results["neural"]["embedder"] = f"tiny preset trained {args.embedder_steps} steps"
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    if "mix" not in args.skip:
        results["mix_search"] = measured("mix_search", results, search_cells, out, args)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    if "mix_trust" not in args.skip:
        # The same proxies, the optimum kept inside the region they cover. Added after the
        # unconstrained search chose 0.83 of d00/q0 (no proxy gave it more than 0.36),
        # predicted 5.000 and measured 5.443, 0.129 worse than by-size. Hypothesis, written
        # before it ran: inside the proxies' range the prediction errs by about the
        # held-out MAE (0.07) and the chosen mixture is no worse than by-size.
        results["mix_search_trust"] = measured(
            "mix_search_trust", results, search_cells, out, args, trust="proxies",
            reuse=out / "mix_cells" / "mix_search.json", sub="mix_cells_trust")
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("phases",)}, indent=1))


def search_cells(out: Path, args: argparse.Namespace, sub: str = "mix_cells",
                 **options: object) -> dict:
    """`moelab data mix-search --over cells` on the lexical cells at the tiny preset's
    scale: proxies and validation runs are the preset itself (its steps and batch), so
    the predicted loss and the measured one are of the same run length."""
    from moelab.config import load_config
    from moelab.curate.mixsearch import mix_search
    from moelab.train.cli import config_path, parse_overrides

    cfg = load_config(config_path("tiny"), parse_overrides(
        [f"data.path={(out / 'lexical').resolve()}"]))
    return mix_search(cfg, out / sub, over="cells", proxies=args.mix_proxies,
                      proxy_steps=args.mix_steps, validate_steps=args.mix_steps, seeds=2,
                      **options)


if __name__ == "__main__":
    main()
