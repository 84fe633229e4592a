"""`moelab ladder plan|run|fit|report SPEC`: predict a big run's loss from small ones;
`moelab ladder compare BASE VARIANT...`: what a recipe change is worth in compute.

Nothing heavy is imported at the top: jax arrives with the first training step, scipy and
matplotlib with the fit and the plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moelab.jobs.cli import add_ray_arguments, ray_options
from moelab.schema import float_in, int_in


def register(subparsers: argparse._SubParsersAction) -> None:
    ladder = subparsers.add_parser(
        "ladder", help="scaling ladder: small rungs -> pre-registered loss prediction")
    commands = ladder.add_subparsers(dest="ladder_command", required=True)

    def command(name: str, help_: str, func) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help_)
        p.add_argument("spec", type=Path, help="ladder spec YAML, or a preset name: the specs "
                       "in the repository's configs/ladder/dev/ and heldout/ (default, "
                       "blind, h1_two_stage_30x, ...)")
        p.add_argument("--out", type=Path, default=None,
                       help="ladder directory (default: the spec's out, else runs/ladder/<name>)")
        p.set_defaults(func=func)
        return p

    command("plan", "validate the spec and list its runs' size, tokens and compute", _plan)
    run = command("run", "train the rungs, fit, pre-register, train the target, report", _run)
    run.add_argument("--experiment", help="lab experiment id: attach the runs and add the "
                     "prediction to it")
    add_ray_arguments(run)
    command("fit", "fit the trained rungs and print the prediction (writes nothing)", _fit)
    report = command("report", "rebuild report.json/.md and the plots of a finished ladder",
                     _report)
    report.add_argument("--downstream", action="store_true",
                        help="also score every point and the target on the local held-out "
                             "tasks (downstream.md: accuracy and gold-answer bpb vs loss)")
    report.add_argument("--items", type=int_in(1, 1_000_000), default=100,
                        help="items per task (--downstream)")

    compare = commands.add_parser(
        "compare", help="what each variant recipe is worth in compute against the base "
        "(reads finished rungs; trains only missing rungs, and only with --train)")
    compare.add_argument("specs", type=Path, nargs="+",
                         help="BASE.yaml VARIANT.yaml [MORE.yaml ...]: ladder specs")
    compare.add_argument("--at", type=float_in(1.0), action="append", default=None, metavar="C",
                         help="report the multiplier at this compute (FLOPs; repeatable; "
                         "default: the first variant's largest rung)")
    compare.add_argument("--l-inf", type=float_in(0.0), default=None,
                         help="pin the shared irreducible loss (default: fitted jointly)")
    compare.add_argument("--out", type=Path, default=None,
                         help="where report.md, compare.json and compare.png go (default: "
                         "runs/ladder/compare-<base>-<variant>...)")
    compare.add_argument("--experiment", help="lab experiment id: record the multipliers "
                         "there (they then show on the findings page with their intervals)")
    compare.add_argument("--train", action="store_true",
                         help="first train the specs' rungs that have not run (never their "
                         "targets); without it a missing rung is an error")
    add_ray_arguments(compare)
    compare.set_defaults(func=_compare)


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
    _print_passes(spec)
    _print_measured(spec)
    _print_preflight(spec)


def _print_measured(spec) -> None:
    """fit.repetition: measured: what the pre-registration will hold the law to once the
    rungs have trained (so a spec learns its bar before spending their compute)."""
    fit = spec.fit
    if fit.repetition != "measured":
        return
    needs = []
    if fit.require_identified:
        needs.append("no direction of the law's parameters that leaves every rung's loss "
                     "unchanged to move the target's (fit.require_identified)")
    if fit.max_rung_residual is not None:
        needs.append(f"the law within {fit.max_rung_residual:.1%} of its rungs (residual sd, "
                     "fit.max_rung_residual)")
    if fit.precision is not None:
        form = " widened by its error in form (fit.misspecification)" if (
            fit.misspecification) else ""
        needs.append(f"its {fit.confidence:.0%} interval at the target{form} giving "
                     f"{fit.precision_odds:.0%} odds of landing within {fit.precision:.1%} "
                     "(fit.precision, fit.precision_odds)")
    if needs:
        print("after the rungs train, the pre-registration needs " + "; and ".join(needs)
              + ", or it refuses the target in one line")


def _print_preflight(spec) -> None:
    """What `ladder run` would refuse the spec for before its first rung trains."""
    from moelab.errors import UserError
    from moelab.ladder.preflight import check_spec

    try:
        check_spec(spec)
    except UserError as err:
        print(f"ladder run will refuse: {err}")


def _print_passes(spec) -> None:
    """Every run's passes over each source's train tokens, per stage, and whether the
    pre-registration would refuse the target (moelab.ladder.repetition)."""
    from moelab.data.passes import passes_lines
    from moelab.errors import UserError
    from moelab.ladder import repetition

    try:
        rep = repetition.repetition(spec)
    except UserError as err:
        print(f"passes per source: not counted ({err})")
        return
    corpus = repetition.corpus(spec)
    print(f"passes over each source's train tokens, per stage (in the stage, and by its end); "
          f"corpus {corpus['path']}, content sha256 {corpus['content_sha256']}:")
    for name, stages in rep["runs"].items():
        for i, line in enumerate(passes_lines(stages)):
            print(f"{name if i == 0 else '':<16} {line}")
    reason = repetition.refusal(rep)
    if reason:
        print(f"pre-registration will refuse: {reason}")
    elif rep["beyond_rungs"]:
        print(f"the target passes over {rep['beyond_rungs']} beyond the rungs: accepted by "
              "fit.accept_repetition")


def _run(args: argparse.Namespace) -> None:
    from moelab import outputs
    from moelab.ladder.preflight import check_ladder_run
    from moelab.ladder.runner import run_ladder

    options = ray_options(args)
    spec = _spec(args)
    check_ladder_run(spec, args.experiment)  # before the first rung trains
    outputs.mark(spec.out, "ladder run")
    run_ladder(spec, args.experiment, args.ray, cpus=args.cpus_per_run, **options)


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

    spec = _spec(args)
    report_ladder(spec)
    if args.downstream:
        from moelab.ladder.downstream import write_downstream

        write_downstream(spec, args.items)


def _compare(args: argparse.Namespace) -> None:
    from moelab.errors import UserError
    from moelab.ladder.compare import compare_ladders
    from moelab.ladder.spec import load_spec

    if len(args.specs) < 2:
        raise UserError("compare needs a base spec and at least one variant spec")
    specs = [load_spec(p) for p in args.specs]
    out = args.out or Path("runs/ladder") / "-".join(["compare", *(s.name for s in specs)])
    if args.ray is not None and not args.train:
        raise UserError("--ray trains missing rungs, so it needs --train")
    options = ray_options(args)
    result = compare_ladders(specs, out, args.at, args.l_inf, args.experiment, args.train,
                             args.ray, cpus=args.cpus_per_run, **options)
    for name, v in result["variants"].items():
        shape = "varies with C" if v["varies_with_compute"] else "one shared alpha"
        for kind in ("theoretical", "realized"):
            e = v[kind]
            print(f"{name} vs {result['base']}: {kind} {e['value']:.3g}x "
                  f"[{e['interval'][0]:.3g}, {e['interval'][1]:.3g}] "
                  f"({e['confidence']:.0%}) at C={e['at'][0]['compute']:.3g}; {shape}; "
                  f"{'distinguishable' if e['distinguishable'] else 'not distinguishable'} "
                  "from seed noise")
    from moelab.ladder.compare import SLOPE_RANGE

    for name, r in result["recipes"].items():
        if not SLOPE_RANGE[0] <= r["seconds_vs_compute_slope"] <= SLOPE_RANGE[1]:
            print(f"caution: {name}'s wall-clock grows as C^{r['seconds_vs_compute_slope']:.2f}"
                  ", not ~C^1: its realized multiplier reflects overhead or load, not compute")
    print(f"L_inf {result['l_inf']['value']:.4f} ({result['l_inf']['mode']}); report in "
          f"{out / 'report.md'}")
