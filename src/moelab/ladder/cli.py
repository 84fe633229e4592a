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
        p.add_argument("spec", type=Path, help="ladder spec YAML, or a preset name: the specs "
                       "in the repository's configs/ladder/ (default, blind)")
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
    print(f"ladder {spec.name} -> {spec.out} ({spec.evals} evaluations per run)")
    print(f"{'run':<16} {'d_model':>7} {'active':>10} {'tokens':>11} {'compute':>9} "
          f"{'trains':>9} {'lr':>8} {'matrix lr':>9}  from")
    total = 0.0
    for rung in spec.runs():
        s = rung.summary()
        # a branch trains only its decay: the steps before it are its parent's
        cost = s["compute"] * (1 - rung.branch_step / s["steps"])
        total += cost * (rung is not spec.target)
        start = f"{rung.parent}@{rung.branch_step}" if rung.parent else ""
        print(f"{s['name']:<16} {s['d_model']:>7} {s['active_params']:>10,} "
              f"{s['tokens']:>11,} {s['compute']:>9.3g} {cost:>9.3g} {s['lr']:>8.3g} "
              f"{s['matrix_lr']:>9.3g}  {start}")
    print(f"rungs train {total:.3g} FLOPs; the target {spec.target.compute:.3g} "
          f"({spec.target.compute / max(r.compute for r in spec.rungs):.1f}x the largest rung)")


def _run(args: argparse.Namespace) -> None:
    from moelab.ladder.runner import run_ladder

    run_ladder(_spec(args), args.experiment)


def _fit(args: argparse.Namespace) -> None:
    from moelab.ladder.predict import forecast
    from moelab.ladder.runner import finished_rungs

    spec = _spec(args)
    fitted = forecast(spec, *finished_rungs(spec))
    noise = fitted["noise"]
    print(f"seed sd {noise['seed_sd']:.4f} nats ({noise['dof']} dof); per evaluation "
          f"{noise['eval_sd']:.4f}")
    for name, law in fitted["laws"].items():
        if "value" not in law:
            print(f"{name}: skipped ({law['skipped']})")
            continue
        iv, bound = law["interval"], law["fit"].get("at_bound") or []
        print(f"{name}: target {spec.target.name} {law['value']:.4f} [{iv['low']:.4f}, "
              f"{iv['high']:.4f}] ({iv['confidence']:.0%})"
              + (f"; at a bound: {', '.join(bound)}" if bound else ""))
    print(f"pre-registered law: {fitted['prediction']['law']}")


def _report(args: argparse.Namespace) -> None:
    from moelab.ladder.runner import report_ladder

    report_ladder(_spec(args))
