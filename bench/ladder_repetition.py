"""Ladders on the data they see: every ladder target's passes per source, predicted
against actual, and the repetition decay measured on this corpus, in one table.

    moelab data prepare --preset ladder         # once: the fresh-token corpus
    moelab ladder run configs/ladder/dev/repetition_v2.yaml   # measured repetition
    python3 bench/ladder_heldout.py             # the held-out specs on the fresh corpus
    python3 bench/ladder_repetition.py          # reads them all (trains nothing)

Rows (`runs`), each with the spec, its corpus's content sha256, the target's largest passes
over any source (`passes_max`), predicted, actual, relative error and `refused`:

- the measured-repetition ladders (configs/ladder/dev/repetition*.yaml, `fit.repetition:
  measured`): rungs on small unique subsets of the default corpus at 1-16 passes. The
  first (a target at 16 passes, N/U 22 against rungs at most 3.4) is now refused by the
  pre-registration's N/U check and listed so; the second puts repeating rungs on 12.5K
  and 25K-token subsets, up to N/U 27, around its target (8 passes, N/U 11);
- every held-out spec (configs/ladder/heldout/) on the fresh-token ladder corpus, read from
  its finished ladder (a spec not run yet is listed under `not_run`);
- every held-out spec again on the 1.8M-token default corpus: the same spec with only
  `data.path` changed, put through the pre-registration's own repetition check
  (moelab.ladder.repetition). Where it refuses, the row is `refused` with the one-line
  reason and nothing trains; where it would not, the row says it was not run.

`decay` is the law fitted on the last finished repetition ladder's rungs (moelab.ladder.overfit: the
fitted parameters, the interval of P, the penalty's scale) beside Muennighoff et al.'s
decay fitted to the same rungs and its published R*. Writes
bench/results/ladder_repetition/ladder_repetition.json, with the repetition ladder's
pre-registration, report and plots beside it (ladder_repetition/repetition/). It trains
nothing and times nothing, so it does not wait for a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
from pathlib import Path
from typing import Any

from ladder_heldout import keep  # bench/ladder_heldout.py: the files a study folder keeps
from machine import run_main  # bench/machine.py

from moelab.config import read_yaml
from moelab.errors import UserError
from moelab.ladder import repetition
from moelab.ladder.fit import FitError
from moelab.ladder.predict import forecast, interval_refusal, rung_residual_refusal
from moelab.ladder.prereg import REFUSAL_FILE
from moelab.ladder.runner import finished_rungs
from moelab.ladder.spec import LADDER_PRESETS, load_spec, spec_from_dict

RESULTS = Path(__file__).parent / "results" / "ladder_repetition" / "ladder_repetition.json"
# the measured-repetition ladders, in the order they were written; the decay is the last
# finished one's
REPETITION_SPECS = [LADDER_PRESETS / "dev" / f"{name}.yaml" for name in
                    ("repetition", "repetition_v2", "repetition_v3", "repetition_v4",
                     "repetition_v5", "repetition_v6", "repetition_v7", "repetition_v8",
                     "repetition_v9", "repetition_v10", "repetition_v11")]
HELDOUT = LADDER_PRESETS / "heldout"
FORM_ERROR = (Path(__file__).parent / "results" / "repetition_form_error"
              / "repetition_form_error.json")
HELDOUT_RESULTS = Path(__file__).parent / "results" / "ladder_heldout"
DEFAULT_CORPUS = "runs/data/default"
KIND = "moelab.ladder.repetition_table/1"


def finished_report(spec, kept: Path) -> dict[str, Any] | None:
    """The finished ladder's report: from its run directory, or else the copy its study
    folder `kept` (a fresh checkout has no runs/, and a held-out spec is hours of CPU)."""
    for path in (spec.out / "report.json", kept / spec.name / "report.json"):
        if path.is_file():
            return json.loads(path.read_text())
    return None


def row(spec_name: str, corpus: str, report: dict[str, Any]) -> dict[str, Any]:
    """A finished ladder's target: its final loss predicted against actual."""
    passes = report.get("passes") or {}
    return {"spec": spec_name, "corpus": (report.get("corpus") or {}).get("content_sha256"),
            "corpus_path": corpus, "passes_max": passes.get("target_max"),
            "passes_target": passes.get("target"), "passes_rungs_max": passes.get("rungs_max"),
            "predicted": report["predicted"], "actual": report["actual"],
            "interval": {"low": report["interval"]["low"], "high": report["interval"]["high"]},
            "relative_error": report["relative_error"],
            "within_interval": report["within_interval"], "refused": False, "reason": None,
            "compute_ratio": report["compute_ratio"],
            "preregistration_sha256": report["preregistration"]["sha256"]}


def on_default_corpus(path: Path) -> dict[str, Any]:
    """The held-out spec at `path` with data.path the default corpus, through the
    pre-registration's repetition check: refused (with its reason) or not."""
    raw = copy.deepcopy(read_yaml(path, "ladder spec"))
    raw["base"].setdefault("data", {})["path"] = DEFAULT_CORPUS
    raw["out"] = str(Path("runs/ladder/heldout_default") / path.stem)
    return checked(spec_from_dict(raw, f"{path.stem}_default_corpus"))


def checked(spec) -> dict[str, Any]:
    """`spec` (not trained here) through the pre-registration's repetition check."""
    rep = repetition.repetition(spec)
    reason = repetition.refusal(rep)
    corpus = repetition.corpus(spec)
    return {"spec": spec.name, "corpus": corpus["content_sha256"], "corpus_path": corpus["path"],
            "passes_max": rep["target_max"], "passes_target": rep["target"],
            "passes_rungs_max": rep["rungs_max"], "predicted": None, "actual": None,
            "interval": None, "relative_error": None, "within_interval": None,
            "refused": reason is not None,
            "reason": reason or "not refused, and not run by this benchmark",
            "compute_ratio": spec.target.compute / max(r.compute for r in spec.rungs),
            "preregistration_sha256": None}


def refused_after_rungs(spec, row_: dict[str, Any], kept: Path) -> dict[str, Any]:
    """`row_` refused with the pre-registration's one-line reason when every rung of `spec`
    has trained and its forecast refuses the target (the law misses its rungs, or its
    interval is too wide): from the ladder's refusal.json (in its run directory, else the
    copy in its study folder `kept`, for a fresh checkout), else by refitting its trained
    rungs; unchanged while rungs are missing or the forecast stands."""
    for path in (spec.out / REFUSAL_FILE, kept / spec.name / REFUSAL_FILE):
        if path.is_file():
            record = json.loads(path.read_text())
            if spec.out.is_dir():
                keep(spec, kept / spec.name)
            return {**row_, "refused": True, "reason": record["reason"],
                    "refused_after": f"its {len(record['rungs'])} rungs trained",
                    "refusal_created_at": record["created_at"]}
    try:
        results = finished_rungs(spec)
    except UserError:  # rungs not trained yet
        return row_
    try:
        forecast(spec, *results)
    except FitError as err:
        return {**row_, "refused": True, "reason": str(err),
                "refused_after": f"its {len(results[0])} rungs trained"}
    return row_


def interval_today(spec, row_: dict[str, Any], report: dict[str, Any]) -> dict[str, float]:
    """The target's interval as today's code pre-registers it: the record's own, or, where
    the spec now defaults to fit.misspecification (spec.MEASURED_DEFAULTS) and the record
    ran without it, the same rungs' interval widened by the form-error term
    (bench/repetition_form_error.py's refit of them)."""
    recorded = {"value": row_["predicted"], **row_["interval"]}
    ran_with = "misspecification term" in report["interval"].get("method", "")
    widened = form_error_intervals().get(spec.name)
    if not spec.fit.misspecification or ran_with or widened is None:
        return recorded
    return {"value": widened["value"], **widened["interval"]}


@functools.cache
def form_error_intervals() -> dict[str, dict[str, Any]]:
    """bench/repetition_form_error.py's rows by spec, read once ({} before it has run)."""
    if not FORM_ERROR.is_file():
        return {}
    return {r["spec"]: r for r in json.loads(FORM_ERROR.read_text())["runs"]}


def hindsight(spec, kept: Path) -> dict[str, Any]:
    """{"hindsight": ...} for a refused spec whose target was trained anyway, after the
    refusal, by `<spec>_hindsight.yaml` (its rungs and target, fit.precision off, the value
    written before the target trained): what the refusal kept out of the record. Not
    counted in the table; {} when there is none."""
    path = LADDER_PRESETS / "dev" / f"{spec.name}_hindsight.yaml"
    if not path.is_file():
        return {}
    after = load_spec(path)
    report = finished_report(after, kept)
    if report is None:
        return {}
    if after.out.is_dir():
        keep(after, kept / after.name)
    return {"hindsight": {"spec": after.name, "predicted": report["predicted"],
                          "interval": {k: report["interval"][k] for k in ("low", "high")},
                          "actual": report["actual"],
                          "relative_error": report["relative_error"],
                          "within_interval": report["within_interval"],
                          "counted": False}}


def rung_residual(report: dict[str, Any]) -> float:
    """The measured law's residual sd on its rungs relative to their mean loss: what
    fit.max_rung_residual caps (a record written before the cap does not hold it)."""
    return report["repetition_measured"]["rmse"] / statistics.fmean(
        p["mean"] for p in report["points"])


def decay(spec_name: str, report: dict[str, Any]) -> dict[str, Any]:
    """The repetition law fitted on the rungs of `spec_name`, beside Muennighoff's decay."""
    m = report["repetition_measured"]
    params = {k: m[k] for k in ("E", "A", "a", "B", "b", "P", "r", "s", "N0", "D0", "Q0")}
    return {"law": m["formula"], "params": params, "rmse": m["rmse"], "n_points": m["n"],
            "relative_rmse": rung_residual(report),
            "parameter": "P", "interval": {**m["P_interval"], "confidence": m["confidence"]},
            "published": {"law": m["muennighoff"].get("formula"),
                          "r_star": m["muennighoff"].get("published_r_star"),
                          "r_star_fitted_here": m["muennighoff"].get("r_star"),
                          "rmse_fitted_here": m["muennighoff"].get("rmse"),
                          "can_rise": False},
            "spec": spec_name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs, not_run, measured = [], [], None
    try:
        for path in [*REPETITION_SPECS, *sorted(HELDOUT.glob("*.yaml"))]:
            spec = load_spec(path)
            repeating = path in REPETITION_SPECS
            report = finished_report(spec, args.out.parent if repeating else HELDOUT_RESULTS)
            if report is not None:
                runs.append(row(spec.name, spec.target.config.data.path, report))
            if not repeating:  # the held-out specs' files are kept by bench/ladder_heldout.py
                if report is None:
                    not_run.append(spec.name)
                runs.append(on_default_corpus(path))
            elif report is not None:
                measured = decay(spec.name, report)
                r = runs[-1]
                # first: prefixes of each source, narrower than the corpus (through v4)
                r["unique_sample"] = spec.rungs[0].config.data.unique_sample
                rep = repetition.repetition(spec)
                checks = {  # the pre-registration's checks on a measured law, in its order
                    "data.unique_sample": repetition.prefix_refusal(rep),
                    "fit.require_identified": repetition.identification_refusal(rep),
                    "fit.max_rung_residual": rung_residual_refusal(
                        measured["relative_rmse"], measured["rmse"], measured["n_points"],
                        spec.fit.max_rung_residual),
                    "fit.precision": interval_refusal(
                        interval_today(spec, r, report), spec.fit.confidence,
                        spec.fit.precision, spec.fit.precision_odds)}
                refusing = next((k for k, why in checks.items() if why), None)
                if refusing and not r["refused"]:  # added after the record: refuses today
                    r["refused_now"] = (f"{checks[refusing]} (pre-registered before this "
                                        "check, its result stands)")
                    r["refused_now_check"] = refusing
                    r["refused_now_checks"] = [k for k, why in checks.items() if why]
                if spec.out.is_dir():
                    keep(spec, args.out.parent / spec.name)
            else:  # a measured-repetition spec without a target: refused, or not run yet
                refused = checked(spec)
                # a refusal decided after its rungs trained stands as it was decided; a
                # check added since that would refuse it before training is noted beside
                recorded = refused_after_rungs(spec, {**refused, "refused": False},
                                               args.out.parent)
                if recorded["refused"]:
                    if refused["refused"] and refused["reason"] != recorded["reason"]:
                        recorded["refused_now"] = (f"{refused['reason']} (a check added "
                                                   "after it was refused)")
                    refused = recorded
                if refused["refused"]:
                    runs.append({**refused, **hindsight(spec, args.out.parent)})
                else:
                    not_run.append(spec.name)
    except UserError as err:  # a corpus not prepared, say
        raise SystemExit(f"error: {err}") from None
    passes_over = [r for r in runs if (r["passes_max"] or 0) > 1.5]
    met = [r["refused"] or abs(r["relative_error"]) <= 0.02 for r in passes_over]
    # the same with the checks added since a record ran: what today's code would do. The
    # records' results stand; this counts a miss as refused only by a check that exists now
    today = [m or bool(r.get("refused_now")) for m, r in zip(met, passes_over, strict=True)]
    out = {"kind": KIND, "runs": runs, "decay": measured, "not_run": not_run,
           "past_1_5_passes": {"n": len(passes_over), "within_2pct_or_refused": sum(met),
                               "within_2pct_or_refused_today": sum(today)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in runs:
        what = (f"refused: {r['reason']}" if r["refused"] else
                f"predicted {r['predicted']:.4f}, actual {r['actual']:.4f}, "
                f"{r['relative_error']:+.2%}" if r["actual"] is not None else r["reason"])
        print(f"{r['spec']}: passes_max {r['passes_max']:.2f}; {what}"
              + (f" (today: {r['refused_now']})" if r.get("refused_now") else ""))
    if measured:
        iv = measured["interval"]
        print(f"measured decay: P {measured['params']['P']:.4g} [{iv['low']:.4g}, "
              f"{iv['high']:.4g}], r {measured['params']['r']:.3g}, s "
              f"{measured['params']['s']:.3g}; Muennighoff's R* fitted "
              f"{measured['published']['r_star_fitted_here']}, published "
              f"{measured['published']['r_star']}")
    print(f"targets past 1.5 passes: {sum(met)} of {len(met)} within 2% or refused "
          f"({sum(today)} with today's checks); "
          f"not run: {', '.join(not_run) or 'none'} -> {args.out}")


if __name__ == "__main__":
    run_main(main)
