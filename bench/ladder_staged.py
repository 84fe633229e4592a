"""The staged default ladder (configs/ladder/dev/staged.yaml): each stage's end pre-registered,
then scored against the target; the numbers the issue's bar asks for, in one JSON.

    python3 bench/ladder_staged.py [--force]     # ~37 min on 2 idle cores

Runs (or, for the runs already finished in its out directory, just reads) the ladder
with `moelab ladder run`'s code and writes bench/results/ladder_staged/v3/stages.json: `stages`
(each stage's `predicted`, `actual`, `interval`, `relative_error`),
`curve_median_abs_rel_error` (the pre-registered curve against every evaluation of the
target, across the switch) and `wall_s` (all runs' training and scoring), plus the
machine. Its wall time is a claim of the issue's bar (<= 60 min), so a busy machine is
refused as by the other benchmarks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from machine import quiet_start, run_main, write_result  # bench/machine.py

from moelab.ladder.runner import run_ladder
from moelab.ladder.spec import load_spec

RESULTS = Path(__file__).parent / "results" / "ladder_staged" / "v3" / "stages.json"


def summary(report: dict) -> dict:
    """The bar's keys from a ladder report (moelab.ladder.report.build_report)."""
    return {"stages": [{"name": s["name"], "end_step": s["end_step"], "law": s["law"],
                        "predicted": s["predicted"], "actual": s["actual"],
                        "interval": s["interval"], "relative_error": s["relative_error"],
                        "within_interval": s["within_interval"]} for s in report["stages"]],
            "curve_median_abs_rel_error": report["curve_median_abs_rel_error"],
            "wall_s": report["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="run and write on a busy machine")
    args = parser.parse_args()
    before = quiet_start(args.force)
    report = run_ladder(load_spec("staged"))
    out = write_result(RESULTS, {**summary(report), "compute_ratio": report["compute_ratio"],
                                 "preregistration_sha256": report["preregistration"]["sha256"]},
                       before)
    for s in out["stages"]:
        print(f"stage {s['name']} (step {s['end_step']}): predicted {s['predicted']:.4f} "
              f"[{s['interval']['low']:.4f}, {s['interval']['high']:.4f}], actual "
              f"{s['actual']:.4f}: {s['relative_error']:+.2%}")
    print(f"whole curve median |error| {out['curve_median_abs_rel_error']:.2%}; wall "
          f"{out['wall_s'] / 60:.1f} min -> {RESULTS}")


if __name__ == "__main__":
    run_main(main)
