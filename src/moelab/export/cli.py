"""`moelab export` (a run's latest checkpoint -> Hugging Face directory) and
`moelab generate` (text from a run's latest checkpoint).

JAX, torch and safetensors are imported inside the handlers, so `moelab --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moelab.schema import int_in


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="write a run's latest checkpoint as a transformers Qwen3-MoE model")
    export.add_argument("--run-dir", required=True, type=Path, help="a training run directory")
    export.add_argument("--out", required=True, type=Path,
                        help="output directory (must not exist or be empty)")
    export.set_defaults(func=_export)

    gen = subparsers.add_parser("generate", help="sample text from a run's latest checkpoint")
    gen.add_argument("--run-dir", required=True, type=Path, help="a training run directory")
    gen.add_argument("--prompt", default="", help="text to continue ('' = a new document)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus mass to sample from")
    gen.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    gen.set_defaults(func=_generate)


def _load(run_dir: Path):
    from moelab.errors import UserError

    if not run_dir.is_dir():  # checked here: the loader would create it
        raise UserError(f"{run_dir} is not a run directory; pass the --run-dir of a training run")
    try:
        from moelab.train.checkpoint import load_latest
    except ModuleNotFoundError as err:
        if err.name != "moelab.train.checkpoint":
            raise
        raise UserError("this moelab has no checkpoint loader (moelab.train.checkpoint)") from err
    return load_latest(run_dir)


def _tokenizer_or_none(data_path: str):
    """The run's tokenizer, or None (with a note) when its data directory is gone."""
    from moelab.data.tokenizer import load_tokenizer
    from moelab.errors import UserError

    try:
        return load_tokenizer(data_path)
    except UserError as err:
        print(f"note: no tokenizer exported: {err}", file=sys.stderr)
        return None


def _export(args: argparse.Namespace) -> None:
    from moelab.export.hf import check_exportable, export_hf

    model, cfg, step = _load(args.run_dir)
    check_exportable(cfg)  # before the tokenizer is looked for
    if cfg.moe.dispatch != "dropless":
        print(f"note: trained with moe.dispatch={cfg.moe.dispatch}; the export (like "
              "`moelab generate`) computes every expert assignment, dropping none",
              file=sys.stderr)
    out = export_hf(model, cfg, args.out, _tokenizer_or_none(cfg.data.path))
    print(f"exported step {step} of {args.run_dir} to {out}")


def _generate(args: argparse.Namespace) -> None:
    from moelab.data.tokenizer import load_tokenizer
    from moelab.errors import UserError
    from moelab.export.generate import check_length_fits, check_sampling, generate_text

    check_sampling(args.temperature, args.top_p)
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    model, cfg, _ = _load(args.run_dir)
    tokenizer = load_tokenizer(cfg.data.path)
    check_length_fits(cfg, len(tokenizer.encode(args.prompt).ids) + 1 + args.max_new_tokens)
    print(args.prompt + generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                                      args.temperature, args.top_p, args.seed))
