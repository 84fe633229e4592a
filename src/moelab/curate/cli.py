"""`moelab data curate` and `moelab data mix-search`: curation, which trains and loads
models (the neural embedder, the proxy runs), so it sits above train; heavy imports wait
for the handlers."""

from __future__ import annotations

import argparse

from moelab.data.cli import data_commands, executor_options
from moelab.jobs.cli import add_ray_arguments, ray_options
from moelab.schema import float_in, int_in


def register(subparsers: argparse._SubParsersAction) -> None:
    commands = data_commands(subparsers)

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
    executor_options(curate)
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


def run_curate(args: argparse.Namespace) -> int:
    from moelab.curate.pipeline import curate

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
    from moelab.curate.mixsearch import mix_search
    from moelab.model import dispatch  # noqa: F401  (checks moe.dispatch by its registry)
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
