"""`moelab data prepare` and `moelab data stats`; heavy imports wait for the handlers."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from moelab.errors import UserError
from moelab.jobs.cli import add_ray_arguments, ray_options
from moelab.schema import brief, float_in, int_in

# `moelab data prepare`'s default document limit (characters): a longer file is split into
# pieces of at most this many bytes, streamed. `moelab train`'s default corpus passes its own.
MAX_CHARS = 1_000_000


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="build and inspect token datasets")
    commands = data.add_subparsers(dest="data_command", required=True)

    prepare = commands.add_parser(
        "prepare", help="ingest, deduplicate, train a tokenizer and write token shards"
    )
    prepare.add_argument("--out", required=True, help="dataset directory to write")
    prepare.add_argument(
        "--source", action="append", default=[], metavar="NAME=GLOB",
        help="files of one source; repeat for more sources or more globs of one source, "
        "'!GLOB' excludes (default: stdlib code and /usr/share docs prose)",
    )
    prepare.add_argument("--sources", choices=["default", "installed"], default=None,
                         help="a preset instead of --source: 'installed' = every installed "
                         "Python package's sources + system docs (a corpus to measure scale)")
    prepare.add_argument("--vocab-size", type=int_in(260, 2**20), default=4096,
                         help="BPE tokenizer size, special tokens included")
    prepare.add_argument("--chat-tokens", action="store_true",
                         help="also put the chat template's <|im_start|> / <|im_end|> in the "
                         "vocabulary (its last two ids) and store the template: a corpus for "
                         "a base model that is later fine-tuned on conversations")
    prepare.add_argument("--near-dup-threshold", type=float_in(0.0, 1.0), default=0.8,
                         help="MinHash Jaccard at or above which a document is a near dup")
    prepare.add_argument("--val-fraction", type=float_in(0.0, 0.5), default=0.05,
                         help="share of each source's documents held out for validation")
    prepare.add_argument("--min-chars", type=int_in(0), default=200,
                         help="shorter documents are dropped as too_short")
    prepare.add_argument("--max-docs", type=int_in(1), default=None,
                         help="documents per source at most (a reproducible sample)")
    prepare.add_argument("--quality", action="append", default=[], metavar="SCORE=MIN:MAX",
                         help="override a quality threshold, either bound may be empty "
                         "(word_count=20:, dup_5gram_fraction=:0.3, word_count=: turns it off)")
    prepare.add_argument("--shard-docs", type=int_in(1), default=None,
                         help="documents per shard (default 32; small corpora: 2 tasks/worker)")
    prepare.add_argument("--partitions", type=int_in(1, 4096), default=None,
                         help="hash partitions of the dedup keys (default: one per 8 shards, "
                         "at most 64; raise it when a partition task grows too big)")
    prepare.add_argument("--max-chars", type=int_in(0), default=MAX_CHARS,
                         help="a file of more bytes is split into documents of at most this "
                         "many, cut at blank lines or line ends and read piece by piece "
                         "(0 = no limit: a 15.7 MB file then costs ~3 GB in ingest and "
                         "tokenize)")
    prepare.add_argument("--long-files", choices=["split", "drop"], default="split",
                         help="split a file over --max-chars into pieces, or drop it as "
                         "too_long unread (a file of 4x that many bytes is never read whole)")
    _executor_options(prepare)
    prepare.set_defaults(func=run_prepare)

    curate = commands.add_parser(
        "curate", help="embed, cluster and quality-bucket a prepared dataset into mixture "
        "cells (adds DIR/cells and meta.json's 'cells'; the source streams are unchanged)")
    curate.add_argument("dir", help="a dataset directory written by `moelab data prepare`")
    curate.add_argument("--embedder", choices=["lexical", "neural"], default="lexical",
                        help="lexical: hashed TF-IDF + SVD; neural: a moelab checkpoint")
    curate.add_argument("--checkpoint", default=None,
                        help="neural embedder: a run directory trained on this dataset")
    curate.add_argument("--dim", type=int_in(2, 4096), default=192,
                        help="lexical embedding dimensions")
    curate.add_argument("--clusters", type=int_in(1), default=64, help="K fine k-means clusters")
    curate.add_argument("--domains", type=int_in(1), default=8,
                        help="fine clusters merged into this many domains")
    curate.add_argument("--buckets", type=int_in(1, 100), default=5,
                        help="quality buckets (quantiles)")
    curate.add_argument("--sample-docs", type=int_in(1), default=10_000,
                        help="seeded sample for the lexical fit, k-means and quality cuts")
    curate.add_argument("--min-cell-fraction", type=float_in(0.0, 1.0), default=0.01,
                        help="cells with a smaller share of train tokens merge into 'tail'")
    curate.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                        help="draws the sample and seeds k-means")
    _executor_options(curate)
    curate.set_defaults(func=run_curate)

    search = commands.add_parser(
        "mix-search", help="choose mixture weights from small proxy runs and a log-linear "
        "regression, then validate them against the by-size mixture")
    search.add_argument("--config", default="tiny",
                        help="the proxies' model and data (a preset name or a YAML file); "
                        "its data.path is the dataset searched")
    search.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. model.d_model=64")
    search.add_argument("--out", required=True, help="directory for mix_search.json")
    search.add_argument("--over", choices=["sources", "cells"], default="sources",
                        help="mix sources, or the cells of `moelab data curate`")
    search.add_argument("--proxies", type=int_in(1, 100_000), default=24,
                        help="proxy runs, each on Dirichlet-sampled weights")
    search.add_argument("--proxy-steps", type=int_in(1), default=40,
                        help="training steps of each proxy run")
    search.add_argument("--validate-steps", type=int_in(1), default=None,
                        help="steps of each validation run (default: --proxy-steps)")
    search.add_argument("--seeds", type=int_in(1, 1000), default=2,
                        help="validation seeds per mixture")
    search.add_argument("--max-epochs", type=float_in(0.0), default=4.0,
                        help="cap on passes over any component in a validation run")
    search.add_argument("--target", default=None,
                        help="minimise this source's held-out loss (default: the mean)")
    search.add_argument("--holdout", type=int_in(0), default=6,
                        help="proxies held out to measure the regression's error")
    search.add_argument("--kl-weight", type=float_in(0.0), default=0.05,
                        help="penalty on the KL from the by-size weights when optimizing")
    search.add_argument("--eval-batches", type=int_in(1), default=8,
                        help="held-out batches per source scoring each run")
    search.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                        help="draws the proxies' weights")
    search.add_argument("--trust", choices=["none", "proxies"], default="none",
                        help="proxies: keep each weight at most the largest a proxy gave it "
                        "(the region the regression saw)")
    search.add_argument("--reuse-proxies", default=None, metavar="MIX_SEARCH_JSON",
                        help="take the proxy runs of an earlier search with the same "
                        "components, --proxies, --proxy-steps and --seed")
    add_ray_arguments(search, "proxy or validation run")
    search.set_defaults(func=run_mix_search)

    stats = commands.add_parser("stats", help="documents per source and filter, tokens")
    stats.add_argument("dir", help="a dataset directory written by `moelab data prepare`")
    stats.set_defaults(func=run_stats)

    sft = commands.add_parser(
        "sft-set", help="question-answer conversations from man pages and stdlib docstrings")
    sft.add_argument("--out", required=True, help="directory for train.jsonl, val.jsonl and "
                     "sft_meta.json")
    sft.add_argument("--val-fraction", type=float_in(0.0, 0.9), default=0.1,
                     help="share of the questions held out (chosen by each question's hash)")
    sft.add_argument("--max-examples", type=int_in(1), default=None,
                     help="keep this many questions (a hash-ordered sample; default: all)")
    sft.set_defaults(func=run_sft_set)


def _executor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int_in(1), default=None,
                        help="local processes (default: one per CPU)")
    parser.add_argument("--ray", action="store_true",
                        help="run the stages with Ray Data on the cluster RAY_ADDRESS names "
                        "(or a local one); the dataset must be on a path every node sees")


def parse_sources(specs: list[str]) -> dict[str, list[str]] | None:
    """["code=a/*.py", "code=!a/t/*", "prose=*.txt"] -> {"code": [...], "prose": [...]}."""
    sources: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not (sep and name and pattern):
            raise UserError(f"--source expects NAME=GLOB, got {spec!r}")
        sources.setdefault(name, []).append(pattern)
    return sources or None


def parse_quality(specs: list[str]) -> dict[str, list[float | None]]:
    """["word_count=20:", "dup_5gram_fraction=:0.3"] -> {"word_count": [20.0, None], ...}."""
    thresholds: dict[str, list[float | None]] = {}
    for spec in specs:
        name, sep, bounds = spec.partition("=")
        low, colon, high = bounds.partition(":")
        try:
            if not (sep and colon):
                raise ValueError
            thresholds[name] = [float(b) if b else None for b in (low, high)]
            if not all(math.isfinite(b) for b in thresholds[name] if b is not None):
                raise ValueError
        except ValueError:
            raise UserError(f"--quality expects SCORE=MIN:MAX (finite numbers; a bound may "
                            f"be empty), got {brief(spec)}") from None
    return thresholds


def run_prepare(args: argparse.Namespace) -> int:
    from moelab.data.prepare import SOURCE_PRESETS, prepare

    if Path(args.out).exists() and not Path(args.out).is_dir():  # before hours of ingest
        raise UserError(f"--out {args.out} is a file, not a directory; pass a directory")
    sources = parse_sources(args.source)
    if args.sources and sources:
        raise UserError("give --sources PRESET or --source NAME=GLOB, not both")
    prepare(args.out, SOURCE_PRESETS[args.sources] if args.sources else sources,
            vocab_size=args.vocab_size, near_dup_threshold=args.near_dup_threshold,
            val_fraction=args.val_fraction, min_chars=args.min_chars,
            max_docs_per_source=args.max_docs, workers=args.workers, use_ray=args.ray,
            quality_thresholds=parse_quality(args.quality), shard_docs=args.shard_docs,
            partitions=args.partitions, max_chars=args.max_chars or None,
            long_files=args.long_files, chat_tokens=args.chat_tokens)
    return run_stats(argparse.Namespace(dir=args.out))


def run_curate(args: argparse.Namespace) -> int:
    from moelab.data.curate import curate

    entry = curate(args.dir, args.embedder, args.checkpoint, dim=args.dim,
                   clusters=args.clusters, domains=args.domains, buckets=args.buckets,
                   sample_docs=args.sample_docs, min_cell_fraction=args.min_cell_fraction,
                   seed=args.seed, workers=args.workers, use_ray=args.ray)
    report = entry["report"]
    print(f"{report['documents']} documents -> {report['fine_clusters']} fine clusters -> "
          f"{report['domains']} domains (size ratio {report['domain_size_ratio']}, purity "
          f"{report['purity']}, NMI {report['nmi']}) -> {len(entry['cells'])} cells")
    print("  seconds: " + ", ".join(f"{stage} {s:.1f}" for stage, s in entry["seconds"].items()))
    for domain in report["per_domain"]:
        print(f"  {domain['domain']}  {domain['documents']:>6} docs  "
              f"{domain['majority_source']} {domain['majority_share']}  "
              f"{' '.join(domain['top_terms'][:6])}")
    for name, cell in entry["cells"].items():
        print(f"  cell:{name}  train_tokens {cell['train_tokens']}  docs {cell['documents']}")
    return 0


def run_mix_search(args: argparse.Namespace) -> int:
    from moelab.config import load_config
    from moelab.data.mixsearch import mix_search
    from moelab.train.cli import config_path, parse_overrides

    cfg = load_config(config_path(args.config), parse_overrides(args.set))
    result = mix_search(cfg, args.out, args.over, args.proxies, args.proxy_steps,
                        args.validate_steps, args.seeds, args.max_epochs, args.target,
                        args.holdout, args.kl_weight, args.eval_batches, args.seed,
                        args.ray, args.cpus_per_run, trust=args.trust,
                        reuse=args.reuse_proxies, **ray_options(args))
    reg = result["regression"]
    print(f"regression held-out MAE {reg['holdout_mae']:.4f} (max {reg['holdout_max_error']:.4f})")
    print("chosen: " + ", ".join(f"{k} {v:.3f}" for k, v in result["chosen_weights"].items()))
    print(f"predicted {result['predicted_loss']:.4f}  measured {result['measured_loss']:.4f} "
          f"+- {result['measured_loss_sd']:.4f}  by-size {result['baseline_loss']:.4f} +- "
          f"{result['baseline_loss_sd']:.4f}  beats by-size beyond seed noise: "
          f"{result['beats_baseline_beyond_noise']}")
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from moelab.data.loader import read_meta
    from moelab.data.provenance import read_manifest, stats_table

    meta = read_meta(args.dir)
    print(stats_table(read_manifest(args.dir), meta))
    print(f"vocab_size {meta['vocab_size']}  eos_id {meta['eos_id']}")
    return 0


def run_sft_set(args: argparse.Namespace) -> int:
    from moelab.data.sftset import build_sft_set

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} is a file, not a directory; pass a directory")
    meta = build_sft_set(args.out, args.val_fraction, args.max_examples)
    print(f"{args.out}: {meta['examples']['train']} train and {meta['examples']['val']} "
          f"held-out conversations ({meta['by_kind']})")
    return 0
