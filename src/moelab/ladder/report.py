"""The ladder's report: predicted vs actual (JSON and Markdown) and two plots.

fit.png: each point's mean final loss (seed sd as error bars) vs compute, the L(C) fit on
the IsoFLOP minima, and the target's pre-registered prediction (with its interval) beside
the loss it reached. curves.png: the target's pre-registered curve (with its band) against
its measured evaluations, over the rungs' measured curves. Everything shown comes from
the pre-registration record and the runs' metrics, so `ladder report` can rebuild it at
any time without training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter

from moelab.ladder import prereg
from moelab.ladder.fit import PowerLawFit
from moelab.ladder.predict import compare
from moelab.ladder.results import RunResult, timings
from moelab.ladder.spec import LadderSpec

FIELDS = ("E", "A", "alpha", "C0", "rmse", "n")


def build_report(spec: LadderSpec, record: dict[str, Any], actual: RunResult) -> dict[str, Any]:
    p = record["prediction"]
    scored = compare(record, actual)
    seconds = timings(spec.out)
    wall = sum(t["wall_s"] for t in seconds.values())
    return {
        "ladder": spec.name,
        "metric": p["metric"],
        "law": p["law"],
        "predicted": p["value"],
        "interval": {k: p[k] for k in ("low", "high", "confidence", "method")},
        "actual": actual.final_val_loss,
        "actual_by_source": actual.val_loss,
        "relative_error": scored["relative_error"],  # (predicted - actual) / actual
        "abs_relative_error": abs(scored["relative_error"]),
        "within_interval": scored["within_interval"],
        "at_bound": p["at_bound"],
        "laws": scored["laws"],
        "seed_sd": record["noise"]["seed_sd"],
        "noise": record["noise"],
        "curve_median_abs_rel_error": scored["curve_median_abs_rel_error"],
        "curve": scored["curve"],
        "stages": scored["stages"],  # a staged target: each stage's end, predicted vs actual
        "curve_extrapolation": record["laws"].get("curve", {}).get("extrapolation"),
        "stability": {"forecast": record["stability"], "check": scored.get("stability")},
        "backtest": {name: law["backtest"] for name, law in record["laws"].items()
                     if "backtest" in law},
        "lr_check": record["lr_check"],
        "points": record["points"],
        "fits": {name: law.get("fit", law.get("skipped")) for name, law in record["laws"].items()},
        "target": {**{k: v for k, v in record["target"].items() if k != "config"},
                   "final_val_loss": actual.final_val_loss, "curve": actual.curve,
                   "stability": actual.stability},
        "compute_ratio": actual.compute / max(r["compute"] for r in record["points"]),
        "preregistration": {"file": prereg.PREREG_FILE, "created_at": record["created_at"],
                            "sha256": record["sha256"]},
        "code_version": record["code_version"],
        # older pre-registrations counted neither (None)
        "corpus": record.get("corpus"),
        "passes": record.get("passes"),
        # fit.repetition: measured (None otherwise): the rising law's fit, Muennighoff's
        # decay fitted beside the published R*
        "repetition_measured": record.get("repetition", {}).get("measured"),
        # fit.misspecification (None before it): the backtests' coverage of their intervals,
        # how the law was chosen, whether the laws disagree by more than the interval
        "coverage": record.get("coverage"),
        "law_choice": record.get("law_choice"),
        "laws_disagree": p.get("laws_disagree"),
        "wall_s": wall,
        "time_s": {"runs": seconds, "wall_total": wall,
                   "cpu_total": sum(t["cpu_s"] for t in seconds.values())},
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2%}"


def _reach_lines(reach: dict[str, Any] | None) -> list[str]:
    """The curve law's extrapolation along S1 and width, as stated before the target ran."""
    if not reach or "ratio" not in reach:
        return []
    def score(name: str, error: float) -> str:
        return f"{name} n/a (no point to score)" if math.isnan(error) else f"{name} {error:.2%}"

    tests = ", ".join(score(name, b["median_abs_rel_error"])
                      for name, b in reach["backtests"].items() if "median_abs_rel_error" in b)
    return [f"- the target's stable phase runs {reach['ratio']:.1f}x the rungs' longest in "
            f"lr-weighted tokens; the curve law extrapolating within the rungs (median |error|): "
            f"{tests or 'not fitted'}"]


def _stage_lines(stages: list[dict[str, Any]]) -> list[str]:
    """Each stage's end: the pre-registered value, its interval and the measured loss."""
    lines = []
    for st in stages:
        iv = st["interval"]
        actual = "not evaluated" if st["actual"] is None else (
            f"actual {st['actual']:.4f} ({_pct(st['relative_error'])}, "
            f"{'inside' if st['within_interval'] else 'outside'} the interval)")
        label = f"stage {st['index']}" + (f" ({st['name']})" if st["name"] else "")
        lines.append(f"- {label} ends at step {st['end_step']}: predicted {st['predicted']:.4f} "
                     f"[{iv['low']:.4f}, {iv['high']:.4f}] by `{st['law']}`; {actual}")
    return lines


def _passes_lines(passes: dict[str, Any] | None, corpus: dict[str, Any] | None) -> list[str]:
    """The target's and the rungs' passes per source, and the corpus's content hash."""
    if not passes:
        return []
    cells = ", ".join(f"{s} {p:.2f} (rungs at most {passes['rungs_max'].get(s, 0.0):.2f})"
                      for s, p in passes["target"].items())
    note = (f"; past the rungs over {', '.join(passes['beyond_rungs'])}, accepted by "
            "fit.accept_repetition" if passes["beyond_rungs"] else "")
    return [f"- passes over each source's train tokens by the target's end: {cells}{note}; "
            f"corpus {corpus['path']} (content sha256 `{corpus['content_sha256']}`)"]


def _repetition_lines(measured: dict[str, Any] | None) -> list[str]:
    """The measured repetition cost beside the published decay, if the spec measured it."""
    if not measured:
        return []
    iv, m = measured["P_interval"], measured["muennighoff"]
    decay = (f"Muennighoff's decay fitted to the same rungs: R* {m['r_star']:.3g} "
             f"(published {m['published_r_star']}), rmse {m['rmse']:.4f}"
             if "r_star" in m else f"Muennighoff's decay not fitted ({m['skipped']})")
    return [f"- repetition measured on the rungs ({measured['formula']}): P "
            f"{measured['P']:.4g} [{iv['low']:.4g}, {iv['high']:.4g}] "
            f"({measured['confidence']:.0%}), r {measured['r']:.3g}, s {measured['s']:.3g}, "
            f"rmse {measured['rmse']:.4f}; {decay}"]


def _misspec_lines(report: dict[str, Any]) -> list[str]:
    """The law's choice, the backtests' coverage and the laws' disagreement, if recorded."""
    lines = []
    if report["law_choice"]:
        c = report["law_choice"]
        rates = ", ".join(f"{k} {v:.4f}" for k, v in c["rates"].items() if v is not None)
        lines.append(f"- law `{c['chosen']}` ({c['rule']}; misspecification rate per ln C: "
                     f"{rates})")
    cov = report["coverage"]
    if cov and cov["n"]:
        lines.append(f"- coverage over the rungs' extrapolating backtests: {cov['measured']:.0%}"
                     f" inside their {cov['nominal']:.0%} intervals (n = {cov['n']})")
    if report["laws_disagree"]:
        lines.append(f"- {report['laws_disagree']['note']}")
    return lines


def refusal_markdown(record: dict[str, Any]) -> str:
    """refusal.md: a refused pre-registration (runner.write_refusal's record), readable."""
    t, detail = record["target"], record.get("detail") or {}
    largest = max(r["compute"] for r in record["rungs"])
    lines = [f"# Ladder `{record['ladder']}`: refused at pre-registration", "",
             f"Decided {record['created_at']} (code {record['code_version'].get('commit')}) "
             f"after its {len(record['rungs'])} rungs trained; the target was not trained.",
             "", f"> {record['reason']}", "",
             f"- target `{t['name']}`: N_active {t['active_params']:,}, {t['tokens']:,} tokens, "
             f"{t['compute'] / largest:.1f}x the largest rung's compute"]
    lines += _passes_lines(record.get("passes"), record.get("corpus"))
    if "interval" in detail:
        iv = detail["interval"]
        lines += [f"- the law's value at the target: **{detail['value']:.4f}** "
                  f"[{iv['low']:.4f}, {iv['high']:.4f}] ({iv.get('confidence', 0.9):.0%}); "
                  f"{iv['method']}"]
    term = detail.get("misspecification") or {}
    if "terms" in term:
        misses = ", ".join(f"level {x['level']} {x['rel_error']:+.2%} at {x['distance']:.2f} "
                           "ln C" for x in term["terms"])
        lines.append(f"- its refits without the lowest / highest compute level missed them by "
                     f"{misses}: {term['rate_per_ln_compute']:.2%} per ln C, "
                     f"{term['distance_ln_compute']:.2f} ln C to the target")
    if "fit" in detail and "relative_rmse" in detail["fit"]:
        lines.append(f"- the law's residual sd on its rungs: {detail['fit']['relative_rmse']:.2%}"
                     " of their mean loss")
    pin = (detail.get("fit") or {}).get("unpinned_at_target") or {}
    if pin.get("shift"):
        lines.append(f"- a direction of its parameters (mostly {', '.join(pin['parameters'])}) "
                     f"that changes no rung's loss moves the target's by {pin['shift']:.2%} "
                     "per unit step (fit.require_identified)")
    lines += ["", "| run | active params | tokens | compute | final loss |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['active_params']:,} | {r['tokens']:,} | {r['compute']:.3g} "
              f"| {r['final_val_loss']:.4f} |" for r in record["rungs"]]
    return "\n".join(lines) + "\n"


def markdown(report: dict[str, Any]) -> str:
    iv, noise = report["interval"], report["noise"]
    lines = [
        f"# Ladder `{report['ladder']}`: predicted vs actual",
        "",
        f"Metric: {report['metric']}.",
        "",
        f"- predicted by `{report['law']}` (pre-registered "
        f"{report['preregistration']['created_at']}): **{report['predicted']:.4f}**, "
        f"{iv['confidence']:.0%} interval [{iv['low']:.4f}, {iv['high']:.4f}]"
        + (f"; parameters at a bound: {', '.join(report['at_bound'])}"
           if report["at_bound"] else ""),
        f"- actual: **{report['actual']:.4f}**"
        f" ({'inside' if report['within_interval'] else 'outside'} the interval)",
        f"- relative error (predicted - actual) / actual: **{report['relative_error']:+.2%}**",
        f"- whole curve: median |relative error| over the target's evaluations after "
        f"warmup **{_pct(report['curve_median_abs_rel_error']).lstrip('+')}**",
        *_reach_lines(report["curve_extrapolation"]),
        *_stage_lines(report["stages"]),
        f"- seed noise: sd {noise['seed_sd']:.4f} nats per run at the end ({noise['dof']} "
        f"dof, {noise['source']}); {noise['eval_sd']:.4f} per evaluation point",
        f"- target at {report['compute_ratio']:.1f}x the largest rung's compute",
        *_passes_lines(report["passes"], report["corpus"]),
        *_repetition_lines(report["repetition_measured"]),
        *_misspec_lines(report),
        "", f"Interval: {iv['method']}.", "",
        "| law | predicted | relative error | inside its interval |", "|---|---|---|---|"]
    for name, law in report["laws"].items():
        lines.append(f"| {name} | {law['value']:.4f} | {law['relative_error']:+.2%} | "
                     f"{'yes' if law['within_interval'] else 'no'} |")
    for name, fit in report["fits"].items():
        if isinstance(fit, str):
            lines.append(f"\n{name}: skipped ({fit})")
        elif fit.get("at_bound"):
            lines.append(f"\n{name}: parameters at a bound (not identified): "
                         f"{', '.join(fit['at_bound'])}")
        if isinstance(fit, dict) and fit.get("unidentified"):
            lines.append(f"\n{name}: not identified by the points (its Jacobian's condition "
                         f"number {fit['condition']:.2g}, over 1e8): a direction of its "
                         "parameters changes no rung's loss, so its value at the target is set "
                         "by where the fit stops (as with rungs at two token counts)")
    lines += ["", "Leave-one-compute-level-out backtest (mean |relative error| of the held-out "
              "level's points):", ""]
    for name, levels in report["backtest"].items():
        cells = ", ".join(f"L{b['level']}: {b['mean_abs_rel_error']:.2%}" if "points" in b
                          else f"L{b['level']}: skipped" for b in levels)
        lines.append(f"- {name}: {cells}")
    lines += ["", "| point | active params | tokens | compute | seeds | mean final loss | sd |",
              "|---|---|---|---|---|---|---|"]
    for r in report["points"]:
        sd = "" if r["sd"] is None else f"{r['sd']:.4f}"
        lines.append(f"| {r['point']} | {r['active_params']:,} | {r['tokens']:,} | "
                     f"{r['compute']:.3g} | {len(r['seeds'])} | {r['mean']:.4f} | {sd} |")
    check = report["stability"]["check"]
    if check:
        lines += ["", f"Stability: grad-norm peak predicted {check['predicted_grad_norm_peak']:.3f}"
                  f", actual {check['actual_grad_norm_peak']:.3f} (limit "
                  f"{report['stability']['forecast']['limit']}: expected "
                  f"{'above' if check['expected_above_limit'] else 'below'}, was "
                  f"{'above' if check['above_limit'] else 'below'}); late-stable grad norm "
                  f"{check['predicted_grad_norm']:.3f} vs {check['actual_grad_norm']:.3f}; "
                  f"logit z {check['predicted_logit_z']:.2f} vs {check['actual_logit_z']:.2f}."]
    if "skipped" not in report["lr_check"]:
        lines += ["", "Learning-rate check (final loss at each lr, first seed):", ""]
        for point, e in report["lr_check"].items():
            probes = ", ".join(f"{k}: {v:.4f}" for k, v in e["probes"].items())
            lines.append(f"- {point}: own lr {e['lr']:.4g}: {e['loss']:.4f}; {probes}; best "
                         f"{e['best_lr']:.4g}")
    commit, time_s = report["code_version"], report["time_s"]
    lines += ["", f"Time, all runs: {time_s['wall_total'] / 60:.1f} min wall, "
              f"{time_s['cpu_total'] / 60:.1f} min process CPU. "
              f"Code: {commit['commit']}{' (dirty)' if commit['dirty'] else ''}. "
              f"Pre-registration sha256: `{report['preregistration']['sha256']}`.", "",
              "![loss vs compute](fit.png)", "", "![loss curves](curves.png)", ""]
    return "\n".join(lines)


def plot_fit(record: dict[str, Any], actual: RunResult, path: Path) -> None:
    points = record["points"]
    compute = np.array([r["compute"] for r in points])
    loss = np.array([r["mean"] for r in points])
    sd = np.array([r["sd"] or 0.0 for r in points])
    p = record["prediction"]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.errorbar(compute, loss, yerr=sd, fmt="o", color="C0", capsize=3,
                label="rung points (mean, seed sd)")
    law = record["laws"].get("compute", {})
    if "fit" in law:
        fit = PowerLawFit(**{k: law["fit"][k] for k in FIELDS})
        grid = np.geomspace(compute.min() / 1.5, actual.compute * 1.5, 200)
        ax.plot(grid, fit.predict(grid), color="C0", alpha=0.6,
                label=f"L(C) on IsoFLOP minima = {fit.E:.3f} + {fit.A_raw:.3g} C^-{fit.alpha:.3f}")
    ax.errorbar([actual.compute], [p["value"]], yerr=[[p["value"] - p["low"]],
                [p["high"] - p["value"]]], fmt="o", mfc="none", color="C1", capsize=4,
                label=f"target predicted ({p['law']}) {p['value']:.4f}")
    ax.scatter([actual.compute], [actual.final_val_loss], marker="*", s=140, color="C3",
               zorder=4, label=f"target actual {actual.final_val_loss:.4f}")
    error = (p["value"] - actual.final_val_loss) / actual.final_val_loss
    _save(fig, ax, path, f"ladder {record['ladder']}: relative error {error:+.2%}",
          "training compute C (FLOPs)", "final validation loss (nats/token)")


def _save(fig: Figure, ax, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log")
    # labels at 1, 2 and 5 per decade: matplotlib's own minor labels collide on a span
    # under two decades, and decade labels alone leave a short span nearly unlabelled
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_curves(record: dict[str, Any], actual: RunResult, path: Path) -> None:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    per_token = actual.tokens / record["target"]["steps"]
    for run in record["rungs"]:
        tokens = [e["step"] * run["tokens"] / run["steps"] for e in run["curve"]]
        ax.plot(tokens, [e["loss"] for e in run["curve"]], color="0.6", alpha=0.4,
                linewidth=0.8)
    curve = record["laws"].get("curve", {}).get("points", [])
    if curve:
        tokens = [pt["tokens"] for pt in curve]
        ax.fill_between(tokens, [pt["low"] for pt in curve], [pt["high"] for pt in curve],
                        color="C1", alpha=0.2, label="target: pre-registered band")
        ax.plot(tokens, [pt["predicted"] for pt in curve], color="C1",
                label="target: pre-registered curve")
    ax.plot([e["step"] * per_token for e in actual.curve], [e["loss"] for e in actual.curve],
            "*-", color="C3", label="target: measured")
    ax.plot([], [], color="0.6", label="rungs: measured")
    _save(fig, ax, path, f"ladder {record['ladder']}: whole-val-split loss curves",
          "tokens trained", "validation loss (nats/token)")


def write_report(spec: LadderSpec, record: dict[str, Any], actual: RunResult) -> dict[str, Any]:
    """report.json, report.md, fit.png and curves.png in the ladder's out directory."""
    report = build_report(spec, record, actual)
    out = spec.out
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot_fit(record, actual, out / "fit.png")
    plot_curves(record, actual, out / "curves.png")
    print(f"[ladder {spec.name}] target val_loss {report['actual']:.4f}, predicted "
          f"{report['predicted']:.4f}: relative error {report['relative_error']:+.2%}; "
          f"report in {out / 'report.md'}", flush=True)
    return report
