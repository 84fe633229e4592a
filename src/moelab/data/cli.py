"""`moelab data prepare` and `moelab data stats` (`moelab.curate.cli` adds curate and
mix-search); heavy imports wait for the handlers."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from moelab.errors import UserError
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
    prepare.add_argument("--out", default=None, help="dataset directory to write (with "
                         "--preset: default, the preset's data.path under $MOELAB_HOME)")
    prepare.add_argument("--preset", choices=sorted(CORPUS_PRESET_NAMES), default=None,
                         help="a named corpus, every setting fixed (ladder: the default sources "
                         "without the 400-file cap, ~35M train tokens; data.path "
                         "runs/data/ladder)")
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
    executor_options(prepare)
    prepare.set_defaults(func=run_prepare)

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


def data_commands(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The subcommands of `moelab data` (registered first), for a part above data that
    adds its own there (curate)."""
    data = subparsers.choices["data"]
    return next(a for a in data._actions if isinstance(a, argparse._SubParsersAction))


def executor_options(parser: argparse.ArgumentParser) -> None:
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


# The options a corpus preset fixes: {prepare()'s keyword: (its argparse dest, its flag)}.
PRESET_OPTIONS = {"vocab_size": ("vocab_size", "--vocab-size"),
                  "near_dup_threshold": ("near_dup_threshold", "--near-dup-threshold"),
                  "val_fraction": ("val_fraction", "--val-fraction"),
                  "min_chars": ("min_chars", "--min-chars"),
                  "max_docs_per_source": ("max_docs", "--max-docs"),
                  "max_chars": ("max_chars", "--max-chars"),
                  "long_files": ("long_files", "--long-files")}
CORPUS_PRESET_NAMES = ("ladder",)  # moelab.data.prepare.CORPUS_PRESETS (imported lazily)


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """args with --preset's sources, settings and (unless given) --out filled in; an option
    that the preset fixes given another value is refused, so a preset's name always means
    the same settings."""
    from moelab.config import data_dir
    from moelab.data.prepare import CORPUS_PRESETS

    preset = CORPUS_PRESETS[args.preset]
    if args.source or args.sources or args.quality:
        raise UserError(f"--preset {args.preset} fixes the sources and quality thresholds; "
                        "drop --source/--sources/--quality, or drop --preset")
    for key, value in preset["settings"].items():
        dest, flag = PRESET_OPTIONS[key]
        if getattr(args, dest) != value:
            raise UserError(f"--preset {args.preset} fixes {flag} to {value}; drop {flag} "
                            f"{getattr(args, dest)}, or drop --preset")
    out = args.out or str(data_dir(preset["path"]))
    return argparse.Namespace(**{**vars(args), "sources": preset["sources"], "out": out})


def run_prepare(args: argparse.Namespace) -> int:
    from moelab import outputs
    from moelab.data.loader import META_FILE
    from moelab.data.prepare import SOURCE_PRESETS, WORK_DIR, prepare
    from moelab.data.provenance import MANIFEST_DIR

    if args.preset:
        args = apply_preset(args)
    if args.out is None:
        raise UserError("--out: give the dataset directory to write (or a --preset)")
    out = Path(args.out)  # checked before hours of ingest; a dataset of its own resumes
    outputs.check_dir(out, ours=any((out / name).exists()
                                    for name in (META_FILE, WORK_DIR, MANIFEST_DIR)))
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


def run_stats(args: argparse.Namespace) -> int:
    from moelab.data.loader import read_meta
    from moelab.data.provenance import read_manifest, stats_table

    meta = read_meta(args.dir)
    print(stats_table(read_manifest(args.dir), meta))
    print(f"vocab_size {meta['vocab_size']}  eos_id {meta['eos_id']}")
    return 0


def run_sft_set(args: argparse.Namespace) -> int:
    from moelab import outputs
    from moelab.data.sftset import META, build_sft_set

    out = Path(args.out)  # a set of its own is rewritten; a user's train.jsonl never
    outputs.check_dir(out, ours=(out / META).is_file())
    meta = build_sft_set(args.out, args.val_fraction, args.max_examples)
    print(f"{args.out}: {meta['examples']['train']} train and {meta['examples']['val']} "
          f"held-out conversations ({meta['by_kind']})")
    return 0
