"""`moelab eval ...`: evaluations of a finished run. `longctx`: the long-context probes.

Heavy imports happen inside the handler, so `moelab --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a trained run")
    add_longctx(parser.add_subparsers(dest="eval_command", required=True))


def add_longctx(evals: argparse._SubParsersAction) -> None:
    """The `longctx` subcommand, on whichever `moelab eval` parser holds the others."""
    p = evals.add_parser("longctx", help="loss by position, passkey retrieval and short-"
                         "context loss of a run's newest checkpoint (JSON; lab if attached)")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--original", type=int, default=0,
                   help="the pre-extension context (0: model.rope's original length, else "
                   "data.seq_len / model.rope.factor)")
    p.add_argument("--max-multiple", type=int, default=8,
                   help="longest passkey/position eval, in multiples of the original")
    p.add_argument("--trials", type=int, default=8, help="passkeys per length and depth")
    p.add_argument("--out", type=Path, help="JSON path (default RUN_DIR/longctx.json)")
    p.set_defaults(func=_longctx)


def _longctx(args: argparse.Namespace) -> int:
    from moelab.errors import UserError
    from moelab.eval.longctx import run

    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a run directory; pass a training run's dir")
    result = run(args.run_dir, args.original or None, args.max_multiple, args.trials, args.out)
    last = result["loss_by_position"]["buckets"]
    print(f"step {result['step']}: short-context loss {result['short_context_loss']['mean']:.4f}"
          + (f", last-bucket loss {last[-1]['loss']:.4f}" if last else "")
          + f"; written to {args.out or args.run_dir / 'longctx.json'}")
    return 0
