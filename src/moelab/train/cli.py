"""`moelab train`: train (or resume) a run, optionally under a restarting supervisor."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

import yaml

PRESETS = ("tiny", "small")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train an MoE model (resumes if the run exists)")
    p.add_argument("--config", default="tiny",
                   help=f"a YAML file, or a built-in preset: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--run-dir", help="where checkpoints and metrics go (default runs/<config>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=100 (YAML value)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="supervise: restart a crashed worker from its checkpoint up to N times")
    p.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart; doubles each time")
    p.add_argument("--experiment", help="attach this run to a lab experiment id")
    p.set_defaults(func=run)


def config_path(name: str) -> Path:
    if name in PRESETS:
        return Path(str(resources.files("moelab") / "presets" / f"{name}.yaml"))
    return Path(name)


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"moelab train: --set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def run(args: argparse.Namespace) -> int:
    from moelab.config import load_config

    cfg = load_config(config_path(args.config), parse_overrides(args.set))
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    if args.max_restarts > 0:
        from moelab.train.supervisor import supervise

        return supervise(worker_argv(args, run_dir), run_dir, args.max_restarts,
                         args.restart_backoff, args.experiment)
    from moelab.train.trainer import DivergenceError, train

    try:
        summary = train(cfg, run_dir, args.experiment)
    except DivergenceError as err:
        print(f"moelab train: diverged: {err}", file=sys.stderr)
        return 3
    print(f"done: step {summary['step']}, loss {summary.get('loss', float('nan')):.4f}, "
          f"run dir {run_dir}")
    return 0


def worker_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The same training command, without supervision, for the supervisor to run."""
    argv = ["train", "--config", args.config, "--run-dir", str(run_dir)]
    for item in args.set:
        argv += ["--set", item]
    return argv + (["--experiment", args.experiment] if args.experiment else [])
