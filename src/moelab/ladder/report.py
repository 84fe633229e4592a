"""The ladder's report: predicted vs actual (JSON and Markdown) and two plots.

fit.png: final validation loss vs compute for the rungs, the fitted law with its bootstrap
band out to the target, and the target's pre-registered prediction (with its interval)
beside the loss it actually reached. curves.png: each run's training loss vs step.
Everything shown comes from the pre-registration record and the runs' metrics files, so
`ladder report` can rebuild it at any time without training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from moelab.ladder import prereg
from moelab.ladder.fit import PowerLawFit, bootstrap_interval
from moelab.ladder.runner import RunResult, metrics, run_dir, timings
from moelab.ladder.spec import LadderSpec

FIELDS = ("E", "A", "alpha", "C0", "rmse", "n")


def power_fit(record: dict[str, Any]) -> PowerLawFit:
    return PowerLawFit(**{k: record["fit"][k] for k in FIELDS})


def build_report(spec: LadderSpec, record: dict[str, Any], actual: RunResult) -> dict[str, Any]:
    p = record["prediction"]
    error = (p["value"] - actual.final_val_loss) / actual.final_val_loss
    secondary = dict(record["secondary"])
    if "value" in secondary:
        secondary["relative_error"] = ((secondary["value"] - actual.final_val_loss)
                                       / actual.final_val_loss)
    seconds = timings(spec.out)
    return {
        "ladder": spec.name,
        "metric": p["metric"],
        "predicted": p["value"],
        "interval": {k: p[k] for k in ("low", "high", "confidence", "method")},
        "actual": actual.final_val_loss,
        "actual_by_source": actual.val_loss,
        "relative_error": error,  # (predicted - actual) / actual
        "abs_relative_error": abs(error),
        "within_interval": p["low"] <= actual.final_val_loss <= p["high"],
        "fit": record["fit"],
        "secondary": secondary,
        "rungs": [{k: v for k, v in r.items() if k != "config"} for r in record["rungs"]],
        "target": {**{k: v for k, v in record["target"].items() if k != "config"},
                   "final_val_loss": actual.final_val_loss},
        "compute_ratio": actual.compute / max(r["compute"] for r in record["rungs"]),
        "preregistration": {"file": prereg.PREREG_FILE, "created_at": record["created_at"],
                            "sha256": record["sha256"]},
        "code_version": record["code_version"],
        "time_s": {"runs": seconds,
                   "wall_total": sum(t["wall_s"] for t in seconds.values()),
                   "cpu_total": sum(t["cpu_s"] for t in seconds.values())},
    }


def markdown(report: dict[str, Any]) -> str:
    fit, iv = report["fit"], report["interval"]
    lines = [
        f"# Ladder `{report['ladder']}`: predicted vs actual",
        "",
        f"Metric: {report['metric']}.",
        "",
        f"- predicted (pre-registered {report['preregistration']['created_at']}): "
        f"**{report['predicted']:.4f}**, {iv['confidence']:.0%} interval "
        f"[{iv['low']:.4f}, {iv['high']:.4f}]",
        f"- actual: **{report['actual']:.4f}**"
        f" ({'inside' if report['within_interval'] else 'outside'} the interval)",
        f"- relative error (predicted - actual) / actual: **{report['relative_error']:+.2%}**",
        f"- fit: L(C) = {fit['E']:.4f} + {fit['A_raw']:.4g} * C^-{fit['alpha']:.4f} "
        f"(rmse {fit['rmse']:.4f} over {fit['n']} rungs); target at "
        f"{report['compute_ratio']:.1f}x the largest rung's compute",
    ]
    secondary = report["secondary"]
    if "value" in secondary:
        nd = secondary["fit"]
        bound = f"; at a bound: {', '.join(nd['at_bound'])}" if nd["at_bound"] else ""
        lines.append(f"- secondary, L(N, D) = E + A/N^a + B/D^b: {secondary['value']:.4f} "
                     f"({secondary['relative_error']:+.2%}; E={nd['E']:.3f}, a={nd['a']:.3f}, "
                     f"b={nd['b']:.3f}{', a=b tied' if nd['tied'] else ''}{bound})")
    else:
        lines.append(f"- secondary L(N, D) fit skipped: {secondary['skipped']}")
    lines += ["", f"Interval: {iv['method']}.", "",
              "| run | d_model | layers | experts (top-k) | active params | tokens | "
              "compute (FLOPs) | final val loss | wall (s) |",
              "|---|---|---|---|---|---|---|---|---|"]
    spent = report["time_s"]["runs"]
    for r in [*report["rungs"], report["target"]]:
        lines.append(
            f"| {r['name']} | {r['d_model']} | {r['n_layers']} | "
            f"{r['n_experts']} ({r['top_k']}) | {r['active_params']:,} | "
            f"{r['tokens']:,} | {r['compute']:.3g} | {r['final_val_loss']:.4f} | "
            f"{spent.get(r['name'], {}).get('wall_s', float('nan')):.0f} |")
    commit = report["code_version"]
    time_s = report["time_s"]
    lines += ["", f"Training time, all runs: {time_s['wall_total'] / 60:.1f} min wall, "
              f"{time_s['cpu_total'] / 60:.1f} min process CPU. "
              f"Code: {commit['commit']}{' (dirty)' if commit['dirty'] else ''}. "
              f"Pre-registration sha256: `{report['preregistration']['sha256']}`.", "",
              "![loss vs compute](fit.png)", "", "![loss curves](curves.png)", ""]
    return "\n".join(lines)


def plot_fit(record: dict[str, Any], actual: RunResult, path: Path) -> None:
    fit = power_fit(record)
    compute = np.array([r["compute"] for r in record["rungs"]])
    loss = np.array([r["final_val_loss"] for r in record["rungs"]])
    options = record["fit_options"]
    interval = bootstrap_interval(fit, compute, loss, actual.compute, options["bootstrap"],
                                  options["confidence"], options["seed"])
    grid = np.geomspace(compute.min() / 1.5, actual.compute * 1.5, 200)
    low, high = interval.band(grid, fit)
    p = record["prediction"]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.fill_between(grid, low, high, alpha=0.2, color="C0",
                    label=f"{p['confidence']:.0%} bootstrap band")
    ax.plot(grid, fit.predict(grid), color="C0",
            label=f"L = {fit.E:.3f} + {fit.A_raw:.3g} C^-{fit.alpha:.3f}")
    ax.scatter(compute, loss, color="C0", zorder=3, label="rungs")
    ax.errorbar([actual.compute], [p["value"]], yerr=[[p["value"] - p["low"]],
                [p["high"] - p["value"]]], fmt="o", mfc="none", color="C1", capsize=4,
                label=f"target predicted {p['value']:.4f}")
    ax.scatter([actual.compute], [actual.final_val_loss], marker="*", s=140, color="C3",
               zorder=4, label=f"target actual {actual.final_val_loss:.4f}")
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final validation loss (nats/token)")
    error = (p["value"] - actual.final_val_loss) / actual.final_val_loss
    ax.set_title(f"ladder {record['ladder']}: relative error {error:+.2%}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def smooth(values: np.ndarray, weight: float = 0.9) -> np.ndarray:
    """Exponential moving average, debiased like TensorBoard's."""
    out, avg = np.empty_like(values), 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out[i] = avg / (1 - weight ** (i + 1))
    return out


def plot_curves(spec: LadderSpec, path: Path) -> None:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, rung in enumerate(spec.runs()):
        records = [r for r in metrics(run_dir(spec, rung)) if "loss" in r]
        if not records:
            continue
        steps = np.array([r["step"] for r in records])
        loss = np.array([r["loss"] for r in records])
        ax.plot(steps, loss, color=f"C{i}", alpha=0.2, linewidth=0.7)
        ax.plot(steps, smooth(loss), color=f"C{i}", label=rung.name)
    ax.set_xscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (EMA 0.9; raw faint)")
    ax.set_title(f"ladder {spec.name}: loss curves")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(spec: LadderSpec, record: dict[str, Any], actual: RunResult) -> dict[str, Any]:
    """report.json, report.md, fit.png and curves.png in the ladder's out directory."""
    report = build_report(spec, record, actual)
    out = spec.out
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot_fit(record, actual, out / "fit.png")
    plot_curves(spec, out / "curves.png")
    print(f"[ladder {spec.name}] target val_loss {report['actual']:.4f}, predicted "
          f"{report['predicted']:.4f}: relative error {report['relative_error']:+.2%}; "
          f"report in {out / 'report.md'}", flush=True)
    return report
