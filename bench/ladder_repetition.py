"""Ladders on the data they see: every ladder target's passes per source, predicted
against actual, and the repetition decay measured on this corpus, in one table.

    moelab data prepare --preset ladder         # once: the fresh-token corpus
    moelab ladder run repetition                # the measured-repetition ladder (~20 min)
    python3 bench/ladder_heldout.py             # the held-out specs on the fresh corpus
    python3 bench/ladder_repetition.py          # reads them all (trains nothing)

Rows (`runs`), each with the spec, its corpus's content sha256, the target's largest passes
over any source (`passes_max`), predicted, actual, relative error and `refused`:

- the measured-repetition ladder (configs/ladder/dev/repetition.yaml, `fit.repetition:
  measured`): rungs on a 100K-token unique subset of the default corpus at 1-16 passes,
  a target at 16 passes;
- every held-out spec (configs/ladder/heldout/) on the fresh-token ladder corpus, read from
  its finished ladder (a spec not run yet is listed under `not_run`);
- every held-out spec again on the 1.8M-token default corpus: the same spec with only
  `data.path` changed, put through the pre-registration's own repetition check
  (moelab.ladder.repetition). Where it refuses, the row is `refused` with the one-line
  reason and nothing trains; where it would not, the row says it was not run.

`decay` is the law fitted on the repetition ladder's rungs (moelab.ladder.overfit: the
fitted parameters, the interval of P, the penalty's scale) beside Muennighoff et al.'s
decay fitted to the same rungs and its published R*. Writes
bench/results/ladder_repetition/ladder_repetition.json, with the repetition ladder's
pre-registration, report and plots beside it (ladder_repetition/repetition/). It trains
nothing and times nothing, so it does not wait for a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from ladder_heldout import keep  # bench/ladder_heldout.py: the files a study folder keeps

from moelab.config import read_yaml
from moelab.errors import UserError
from moelab.ladder import repetition
from moelab.ladder.spec import LADDER_PRESETS, load_spec, spec_from_dict

RESULTS = Path(__file__).parent / "results" / "ladder_repetition" / "ladder_repetition.json"
REPETITION_SPEC = LADDER_PRESETS / "dev" / "repetition.yaml"
HELDOUT = LADDER_PRESETS / "heldout"
DEFAULT_CORPUS = "runs/data/default"
KIND = "moelab.ladder.repetition_table/1"


def finished_report(spec) -> dict[str, Any] | None:
    path = spec.out / "report.json"
    return json.loads(path.read_text()) if path.is_file() else None


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
    spec = spec_from_dict(raw, f"{path.stem}_default_corpus")
    rep = repetition.repetition(spec)
    reason = repetition.refusal(rep)
    corpus = repetition.corpus(spec)
    return {"spec": spec.name, "corpus": corpus["content_sha256"], "corpus_path": DEFAULT_CORPUS,
            "passes_max": rep["target_max"], "passes_target": rep["target"],
            "passes_rungs_max": rep["rungs_max"], "predicted": None, "actual": None,
            "interval": None, "relative_error": None, "within_interval": None,
            "refused": reason is not None,
            "reason": reason or "not refused, and not run by this benchmark",
            "compute_ratio": spec.target.compute / max(r.compute for r in spec.rungs),
            "preregistration_sha256": None}


def decay(report: dict[str, Any]) -> dict[str, Any]:
    """The repetition law fitted on the rungs, beside Muennighoff's decay."""
    m = report["repetition_measured"]
    params = {k: m[k] for k in ("E", "A", "a", "B", "b", "P", "r", "s", "N0", "D0", "Q0")}
    return {"law": m["formula"], "params": params, "rmse": m["rmse"], "n_points": m["n"],
            "parameter": "P", "interval": {**m["P_interval"], "confidence": m["confidence"]},
            "published": {"law": m["muennighoff"].get("formula"),
                          "r_star": m["muennighoff"].get("published_r_star"),
                          "r_star_fitted_here": m["muennighoff"].get("r_star"),
                          "rmse_fitted_here": m["muennighoff"].get("rmse"),
                          "can_rise": False},
            "spec": report.get("spec") or REPETITION_SPEC.stem}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs, not_run, measured = [], [], None
    for path in [REPETITION_SPEC, *sorted(HELDOUT.glob("*.yaml"))]:
        spec = load_spec(path)
        report = finished_report(spec)
        if report is None:
            not_run.append(spec.name)
        else:
            runs.append(row(spec.name, spec.target.config.data.path, report))
        if path == REPETITION_SPEC:  # its files are kept here; the held-out specs' by theirs
            if report is not None:
                measured = decay(report)
                keep(spec, args.out.parent / spec.name)
            continue
        try:
            runs.append(on_default_corpus(path))
        except UserError as err:  # the default corpus not prepared, say
            raise SystemExit(f"error: {err}") from None
    passes_over = [r for r in runs if (r["passes_max"] or 0) > 1.5]
    met = [r["refused"] or abs(r["relative_error"]) <= 0.02 for r in passes_over]
    out = {"kind": KIND, "runs": runs, "decay": measured, "not_run": not_run,
           "past_1_5_passes": {"n": len(passes_over), "within_2pct_or_refused": sum(met)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in runs:
        what = (f"refused: {r['reason']}" if r["refused"] else
                f"predicted {r['predicted']:.4f}, actual {r['actual']:.4f}, "
                f"{r['relative_error']:+.2%}" if r["actual"] is not None else r["reason"])
        print(f"{r['spec']}: passes_max {r['passes_max']:.2f}; {what}")
    if measured:
        iv = measured["interval"]
        print(f"measured decay: P {measured['params']['P']:.4g} [{iv['low']:.4g}, "
              f"{iv['high']:.4g}], r {measured['params']['r']:.3g}, s "
              f"{measured['params']['s']:.3g}; Muennighoff's R* fitted "
              f"{measured['published']['r_star_fitted_here']}, published "
              f"{measured['published']['r_star']}")
    print(f"targets past 1.5 passes: {sum(met)} of {len(met)} within 2% or refused; "
          f"not run: {', '.join(not_run) or 'none'} -> {args.out}")


if __name__ == "__main__":
    main()
