"""`moelab ladder plan|run|fit|report SPEC`: predict a big run's loss from small ones.

Nothing heavy is imported at the top: jax arrives with the first training step, scipy and
matplotlib with the fit and the plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    ladder = subparsers.add_parser(
        "ladder", help="scaling ladder: small rungs -> pre-registered loss prediction")
    commands = ladder.add_subparsers(dest="ladder_command", required=True)

    def command(name: str, help_: str, func) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help_)
        p.add_argument("spec", type=Path, help="ladder spec YAML, e.g. configs/ladder/default.yaml")
        p.add_argument("--out", type=Path, default=None,
                       help="ladder directory (default: the spec's out, else runs/ladder/<name>)")
        p.set_defaults(func=func)
        return p

    command("plan", "validate the spec and list its runs' size, tokens and compute", _plan)
    run = command("run", "train the rungs, fit, pre-register, train the target, report", _run)
    run.add_argument("--experiment", help="lab experiment id: attach the runs and add the "
                     "prediction to it")
    command("fit", "fit the trained rungs and print the prediction (writes nothing)", _fit)
    command("report", "rebuild report.json/.md and the plots of a finished ladder", _report)


def _spec(args: argparse.Namespace):
    from moelab.ladder.spec import load_spec

    return load_spec(args.spec, args.out)


def _plan(args: argparse.Namespace) -> None:
    spec = _spec(args)
    print(f"ladder {spec.name} -> {spec.out}")
    print(f"{'run':<10} {'d_model':>7} {'layers':>6} {'experts':>7} {'active':>10} "
          f"{'tokens':>11} {'compute':>9} {'x prev':>6}")
    previous = None
    for rung in spec.runs():
        s = rung.summary()
        ratio = f"{s['compute'] / previous:6.1f}" if previous else ""
        print(f"{s['name']:<10} {s['d_model']:>7} {s['n_layers']:>6} "
              f"{s['n_experts']:>4}/{s['top_k']:<2} {s['active_params']:>10,} "
              f"{s['tokens']:>11,} {s['compute']:>9.3g} {ratio}")
        previous = s["compute"]


def _run(args: argparse.Namespace) -> None:
    from moelab.ladder.runner import run_ladder

    run_ladder(_spec(args), args.experiment)


def _fit(args: argparse.Namespace) -> None:
    from moelab.ladder.runner import finished_rungs, predict

    spec = _spec(args)
    fitted = predict(spec, finished_rungs(spec))
    fit, p = fitted["fit"], fitted["prediction"]
    print(f"L(C) = {fit['E']:.4f} + {fit['A_raw']:.4g} * C^-{fit['alpha']:.4f} "
          f"(rmse {fit['rmse']:.4f}, {fit['n']} rungs)")
    print(f"target {spec.target.name} at C={spec.target.compute:.3g}: {p['value']:.4f} "
          f"[{p['low']:.4f}, {p['high']:.4f}] ({p['confidence']:.0%})")
    secondary = fitted["secondary"]
    print(f"L(N, D): {secondary['value']:.4f}" if "value" in secondary
          else f"L(N, D) skipped: {secondary['skipped']}")


def _report(args: argparse.Namespace) -> None:
    from moelab.ladder.runner import report_ladder

    report_ladder(_spec(args))
