"""What the form-error term would have said on the repetition specs that ran before it: a
hindsight table (issue 47), written after their targets' results; it chooses nothing.

    python3 bench/repetition_form_error.py    # after `moelab ladder run` of each spec (~1 min)

`fit.misspecification: true` with `fit.repetition: measured` (f49dee8) widens the measured
law's interval by the law's own extrapolating refits (moelab.ladder.predict._widen_measured).
It was written after repetition_v5 landed outside its interval and before it was computed
on any record; its first scored use is repetition_v6, whose spec named it before it ran.
This refits each earlier spec's finished rungs with the option on, as a spec would have
pre-registered then, and sets the widened interval and fit.precision's verdict beside the
target's actual loss. Those specs pre-registered without it and are scored as they did;
this table is not a score.

Writes bench/results/repetition_form_error/repetition_form_error.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from machine import run_main  # bench/machine.py

from moelab.ladder.fit import FitError
from moelab.ladder.predict import forecast
from moelab.ladder.runner import finished_rungs
from moelab.ladder.spec import load_spec

SPECS = ["repetition_v2", "repetition_v3", "repetition_v4", "repetition_v5"]
TABLE = Path(__file__).parent / "results" / "ladder_repetition" / "ladder_repetition.json"
RESULTS = (Path(__file__).parent / "results" / "repetition_form_error"
           / "repetition_form_error.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    actual = {r["spec"]: r for r in json.loads(TABLE.read_text())["runs"]}
    rows = []
    for name in SPECS:
        spec = load_spec(Path("configs/ladder/dev") / f"{name}.yaml")
        # the form-error term alone, as it was studied (fit.require_identified, which came
        # after, refuses all of these rungs: two token counts)
        spec = dataclasses.replace(spec, fit=dataclasses.replace(
            spec.fit, misspecification=True, require_identified=False))
        results, lr_results = finished_rungs(spec)
        row = {"spec": name, "actual": actual[name]["actual"],
               "scored": {"predicted": actual[name]["predicted"],
                          "interval": actual[name]["interval"],
                          "relative_error": actual[name]["relative_error"]}}
        try:
            law = forecast(spec, results, lr_results)["laws"]["repetition"]
        except FitError as err:
            row.update(refused=True, reason=str(err))
            no_precision = dataclasses.replace(spec, fit=dataclasses.replace(
                spec.fit, precision=None, max_rung_residual=None))
            law = forecast(no_precision, results, lr_results)["laws"]["repetition"]
        else:
            row["refused"] = False
        iv, term = law["interval"], law["misspecification"]
        row.update(value=law["value"], interval={"low": iv["low"], "high": iv["high"]},
                   half_width=max(iv["high"] - law["value"], law["value"] - iv["low"])
                   / law["value"],
                   covers=iv["low"] <= row["actual"] <= iv["high"],
                   rate_per_ln_compute=term.get("rate_per_ln_compute"),
                   distance_ln_compute=term.get("distance_ln_compute"),
                   terms=term.get("terms"))
        rows.append(row)
        verdict = "refused" if row["refused"] else "pre-registers"
        print(f"{name}: {row['value']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}] "
              f"(+-{row['half_width']:.1%}), actual {row['actual']:.4f}, "
              f"{'inside' if row['covers'] else 'outside'}; fit.precision: {verdict}; rate "
              f"{row['rate_per_ln_compute']:.4f}/ln C x {row['distance_ln_compute']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "moelab.repetition_form_error/1",
                                    "hindsight": True, "runs": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
