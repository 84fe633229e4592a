"""The `--ray [ADDRESS]` options every command that trains a set of runs shares (ladder
run, ladder compare --train, data mix-search): one definition, one meaning."""

from __future__ import annotations

import argparse


def add_ray_arguments(parser: argparse.ArgumentParser, what: str = "training run") -> None:
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help=f"run each {what} as a Ray task: on the cluster whose head is at "
                        "ADDRESS (HOST:PORT), or with no value on a Ray runtime started here; "
                        "run directories must be on a path every node sees")
    parser.add_argument("--cpus-per-run", type=_positive(float), default=1.0,
                        help=f"CPUs each {what} asks Ray for")
    parser.add_argument("--max-retries", type=_positive(int, zero=True), default=3,
                        help=f"how often Ray retries a {what} whose worker or node died (a "
                        "training run resumes from its last checkpoint); a run's own error is "
                        "never retried")
    parser.add_argument("--stall-timeout", type=_positive(float), default=3600.0,
                        metavar="SECONDS", help="fail if no run changes state or step for "
                        "this long")


def ray_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of `run_jobs` the options above set ({} without --ray)."""
    if args.ray is None:
        return {}
    return {"max_retries": args.max_retries, "stall_timeout_s": args.stall_timeout}


def _positive(kind: type, zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with zero=True), with a one-line error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}"
                                             ) from None
        if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {'>= 0' if zero else '> 0'}, got {text!r}")
        return value

    return parse
