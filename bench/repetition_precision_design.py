"""Would fit.precision pre-register a measured-repetition target at fit.precision_odds 0.9?
The design study behind repetition_v8 (issue 47); it reads rung losses only.

    python3 bench/repetition_precision_design.py     # kept reports, trains nothing (~3 min)

repetition_v5, v6 and v7 trained the same 25 rungs on three seeds. For a candidate target
(a d_model, a spread unique subset and its passes), this fits the measured law on each of
those three sets of rung losses, exactly as the pre-registration would
(moelab.ladder.predict._measured_repetition with fit.misspecification: true), and reads
the widened 90% half-width at the candidate: at fit.precision_odds 0.9 the target is
pre-registered only where it is under fit.precision (2%). The three seeds say how often a
fresh draw of these rungs passes. No target's loss is read, and a candidate under 8x the
largest rung's compute (the ladder's floor, spec.validate_compute) is skipped.

Writes bench/results/repetition_precision_design/repetition_precision_design.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from machine import run_main  # bench/machine.py

from moelab.errors import ConfigError
from moelab.ladder import predict
from moelab.ladder.fit import FitError
from moelab.ladder.spec import LADDER_PRESETS, spec_from_dict

HERE = Path(__file__).parent / "results"
RESULTS = HERE / "repetition_precision_design" / "repetition_precision_design.json"
DRAWS = ("repetition_v5", "repetition_v6", "repetition_v7")  # the same rungs, three seeds
CODE_SHARE = 0.7802  # the default corpus's code share of train tokens, as the specs split
WIDTHS = (160, 192, 224, 256)
UNIQUE = (800_000, 1_000_000, 1_200_000, 1_600_000)
PASSES = (2, 3, 4)
PRECISION = 0.02


def candidate(draw: str, width: int, unique: int, passes: float):
    """The draw's spec with its target replaced by the candidate (None under 8x)."""
    raw = yaml.safe_load((LADDER_PRESETS / "dev" / f"{draw}.yaml").read_text())
    code = round(unique * CODE_SHARE)
    raw["target"] = {"name": "target", "model": {"d_model": width, "d_ff": width},
                     "data": {"unique_tokens": {"code": code, "prose": unique - code}},
                     "train": {"steps": round(passes * unique / 2048)}}
    # the form-error rule alone, as it was studied (fit.require_identified came after)
    raw["fit"].update(misspecification=True, precision=None, require_identified=False)
    try:
        return spec_from_dict(raw, draw)
    except ConfigError:  # under the ladder's 8x floor
        return None


def half_width(spec, points) -> float:
    law = predict._measured_repetition(spec, points, spec.fit)
    iv = law["interval"]
    return max(iv["high"] - law["value"], law["value"] - iv["low"]) / law["value"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    points = {d: json.loads((HERE / "ladder_repetition" / d / "report.json").read_text())
              ["points"] for d in DRAWS}
    rows = []
    for width in WIDTHS:
        for unique in UNIQUE:
            for passes in PASSES:
                specs = {d: candidate(d, width, unique, passes) for d in DRAWS}
                if any(s is None for s in specs.values()):
                    continue
                spec = specs[DRAWS[0]]
                halves = {}
                for draw, s in specs.items():
                    try:
                        halves[draw] = half_width(s, points[draw])
                    except FitError as err:  # fit.max_rung_residual
                        halves[draw] = str(err)
                passing = sum(isinstance(h, float) and h <= PRECISION for h in halves.values())
                rows.append({"d_model": width, "unique_tokens": unique, "passes": passes,
                             "compute_ratio": spec.target.compute
                             / max(r.compute for r in spec.rungs),
                             "half_width": halves, "draws_passing": passing})
                shown = " ".join(f"{h:.1%}" if isinstance(h, float) else "refused"
                                 for h in halves.values())
                print(f"d_model {width} on {unique / 1e6:.1f}M x {passes} passes "
                      f"({rows[-1]['compute_ratio']:.1f}x): half-width {shown}; "
                      f"{passing}/{len(DRAWS)} draws under {PRECISION:.0%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "moelab.repetition_precision_design/1",
                                    "draws": list(DRAWS), "precision": PRECISION,
                                    "confidence": 0.9, "candidates": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
