"""Which curve law extrapolates: rung-only backtests of the forms in CURVE_FORMS on the
project's stored ladders (the pre-registration files hold every rung's whole-split curve).

    python3 bench/curve_law_study.py      # ~1 min; no training

For each stored rung set (v4: lr 3e-3; v5: the width rule at 6e-3) and each form, the law
is fitted on part of the rungs' evaluation points (replicates averaged) and scored on the
rest: `s1_2x` / `s1_3x` fit the points with S1 up to 1/2 / 1/3 of the rungs' largest and
predict the later ones (the extrapolation along lr-weighted tokens that a longer target
asks for); `corner` predicts the widest rung's second half from every other point. The
form with the lowest mean of the three medians is the default. The stored 8x targets'
errors are listed beside, for the record only: they were not used to choose.
Results: bench/results/curve_law_study/curve_law_study.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from machine import run_main  # bench/machine.py

from moelab.config import config_from_dict
from moelab.ladder.curve import schedule_areas
from moelab.ladder.fit import CURVE_FORMS, FitError, fit_curve

RESULTS = Path(__file__).parent / "results"
LADDERS = {"v4_idle": "ladder_default/v4-idle", "v5_default": "ladder_default/v5",
           "v5_blind": "ladder_blind/v1"}  # version folders under bench/results


def points(record: dict) -> np.ndarray:
    """[N, S1, S2, mean loss, d_model] per (point, evaluation step) after warmup."""
    by_point: dict[str, dict] = {}
    for run in record["rungs"]:
        if "-lr" in run["name"]:  # the lr probes are not points of the fit
            continue
        cfg = config_from_dict(run["config"])
        s1, s2 = schedule_areas(cfg)
        entry = by_point.setdefault(run["point"], {"steps": {}, "run": run, "s": (s1, s2)})
        for e in run["curve"]:
            if e["step"] > cfg.optim.warmup_steps:
                entry["steps"].setdefault(e["step"], []).append(e["loss"])
    rows = [(p["run"]["active_params"], p["s"][0][step], p["s"][1][step], np.mean(losses),
             p["run"]["d_model"]) for p in by_point.values()
            for step, losses in sorted(p["steps"].items())]
    return np.array(rows, float)


def target_errors(record: dict, report: dict, form: str, rows: np.ndarray) -> dict:
    cfg = config_from_dict(record["target"]["config"])
    s1, s2 = schedule_areas(cfg)
    curve = [e for e in report["target"]["curve"] if e["step"] > cfg.optim.warmup_steps]
    steps = np.array([e["step"] for e in curve])
    actual = np.array([e["loss"] for e in curve])
    fit = fit_curve(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], form=form)
    errors = (fit.predict(record["target"]["active_params"], s1[steps], s2[steps]) - actual
              ) / actual
    return {"median_abs_rel_error": float(np.median(np.abs(errors))),
            "final_rel_error": float(errors[-1])}


def backtests(rows: np.ndarray, form: str) -> dict:
    n, s1, s2, y, width = rows.T
    late = s1 > s1.max() / 2
    splits = {"s1_2x": ~late, "s1_3x": s1 <= s1.max() / 3,
              "corner": ~((width == width.max()) & late)}
    out = {}
    for name, fit_on in splits.items():
        try:
            fit = fit_curve(n[fit_on], s1[fit_on], s2[fit_on], y[fit_on], form=form)
        except FitError as err:
            out[name] = {"skipped": str(err)}
            continue
        errors = (fit.predict(n[~fit_on], s1[~fit_on], s2[~fit_on]) - y[~fit_on]) / y[~fit_on]
        out[name] = {"fit_points": int(fit_on.sum()), "scored_points": int((~fit_on).sum()),
                     "median_abs_rel_error": float(np.median(np.abs(errors))),
                     "mean_rel_error": float(np.mean(errors))}
    return out


def main() -> None:
    study: dict = {"ladders": {}, "note": __doc__.split("\n\n")[2].replace("\n", " ")}
    seen: dict[str, str] = {}
    for name, stem in LADDERS.items():
        record = json.loads((RESULTS / stem / "preregistration.json").read_text())
        report = json.loads((RESULTS / stem / "report.json").read_text())
        rows = points(record)
        key = json.dumps(rows.round(6).tolist())
        entry: dict = {"points": len(rows), "target": record["target"]["name"],
                       "target_d_model": record["target"]["d_model"],
                       "target_steps": record["target"]["steps"], "forms": {}}
        for form in CURVE_FORMS:
            tests = backtests(rows, form) if key not in seen else "same rungs as " + seen[key]
            entry["forms"][form] = {"backtests": tests,
                                    "target_not_used": target_errors(record, report, form, rows)}
        seen.setdefault(key, name)
        study["ladders"][name] = entry
    score = {form: float(np.mean([b["median_abs_rel_error"] for e in study["ladders"].values()
                                  if isinstance(e["forms"][form]["backtests"], dict)
                                  for b in e["forms"][form]["backtests"].values()
                                  if "median_abs_rel_error" in b])) for form in CURVE_FORMS}
    study["mean_backtest_median_abs_rel_error"] = score
    study["chosen"] = min(score, key=score.get)
    out = RESULTS / "curve_law_study" / "curve_law_study.json"
    out.write_text(json.dumps(study, indent=1) + "\n")
    for name, entry in study["ladders"].items():
        for form, v in entry["forms"].items():
            tests = v["backtests"]
            cells = tests if isinstance(tests, str) else ", ".join(
                f"{k} {b['median_abs_rel_error']:.2%} (mean {b['mean_rel_error']:+.2%})"
                for k, b in tests.items() if "median_abs_rel_error" in b)
            t = v["target_not_used"]
            print(f"{name:11s} {form:7s} {cells} | target (not used): median "
                  f"{t['median_abs_rel_error']:.2%}, final {t['final_rel_error']:+.2%}")
    print(f"mean backtest median |error|: {score}; chosen: {study['chosen']}")


if __name__ == "__main__":
    run_main(main)
