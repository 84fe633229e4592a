"""Which form of a stage's loss gain carries from the rungs to the next rung: the rung-only
backtest that chose `fit.stage_gain`'s form (configs/ladder/dev/staged.yaml version 3).

    python3 bench/stage_gain_backtest.py [SPEC.yaml:PREREG.json ...]

Reads finished staged ladders' pre-registrations (they hold every rung run's curve) beside
their specs (default: version 2's and its replica's, seeds 3-4 and 5-6). Each rung run measures the
last stage's gain: its loss at its own switch and at its end. Eight forms are fitted on
the runs of one ladder: the gain absolute (nats) or relative (of the loss at the switch),
constant or linear in ln N, in ln D, or in both; each is scored on two held-out splits
that extrapolate the way the target does: fitted on the cooldown branches, predicting the
trunks (further in D), and fitted without the widest rung, predicting it (further in N).
The score is the relative error of the end-of-run loss given the measured loss at the
switch, so only the gain's form is judged. Prints the table and writes
bench/results/stage_gain_backtest/stage_gain_backtest.json; the lowest mean |error| over
every ladder and split is the form moelab fits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from moelab.ladder.predict import stage_gain_rows
from moelab.ladder.results import RunResult
from moelab.ladder.spec import load_spec

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "stage_gain_backtest" / "stage_gain_backtest.json"
CONFIGS = Path(__file__).parents[1] / "configs" / "ladder"
DEFAULT = [f"{CONFIGS / 'staged_v2.yaml'}:{RESULTS / 'ladder_staged/v2/preregistration.json'}",
           f"{CONFIGS / 'staged_replica.yaml'}:"
           f"{RESULTS / 'ladder_staged/v2-replica/preregistration.json'}"]
TERMS = {"const": [], "ln_n": ["ln_n"], "ln_d": ["ln_d"], "ln_n+ln_d": ["ln_n", "ln_d"]}


def ladder_rows(pair: str) -> list[dict]:
    """The rung runs' last-stage gains, from a pre-registration's record of its runs."""
    spec_path, prereg = pair.split(":", 1)
    record = json.loads(Path(prereg).read_text())
    fields = RunResult.__dataclass_fields__
    results = [RunResult(**{k: v for k, v in r.items() if k in fields})
               for r in record["rungs"]]
    return stage_gain_rows(load_spec(spec_path), results, len(record["stages"]) - 1)


def ladder_name(prereg: Path) -> str:
    """A pre-registration's name in the tables: its study/version folder under bench/results
    (every version's file is called preregistration.json), else the file's stem."""
    if prereg.name == "preregistration.json":
        return f"{prereg.parent.parent.name}/{prereg.parent.name}"
    return prereg.stem


def score(rows: list[dict], relative: bool, terms: list[str], fit: np.ndarray) -> np.ndarray:
    """Relative error of each held-out run's end loss, its switch loss given."""
    x = np.array([[1.0, *(r[t] for t in terms)] for r in rows])
    y = np.array([r["gain"] if relative else r["before"] - r["after"] for r in rows])
    beta = np.linalg.lstsq(x[fit], y[fit], rcond=None)[0]
    before = np.array([r["before"] for r in rows])[~fit]
    after = np.array([r["after"] for r in rows])[~fit]
    g = x[~fit] @ beta
    predicted = before * (1 - g) if relative else before - g
    return (predicted - after) / after


def main() -> None:
    pairs = sys.argv[1:] or DEFAULT
    ladders = {}  # each ladder's runs and its two splits, read once
    for pair in pairs:
        rows = ladder_rows(pair)
        n = np.array([r["ln_n"] for r in rows])
        ladders[ladder_name(Path(pair.split(":", 1)[1]))] = (rows, {
            "branches_to_trunks": np.array([r["branch"] for r in rows]),
            "narrow_to_widest": n < n.max()})
    table: dict[str, dict] = {}
    for relative in (False, True):
        for name, terms in TERMS.items():
            form = f"{'relative' if relative else 'absolute'} {name}"
            cells = {}
            for stem, (rows, splits) in ladders.items():
                for split, fit in splits.items():
                    err = score(rows, relative, terms, fit)
                    cells[f"{stem}:{split}"] = {"mean_abs": float(np.abs(err).mean()),
                                                "mean": float(err.mean())}
            table[form] = {"cells": cells, "mean_abs": float(np.mean(
                [c["mean_abs"] for c in cells.values()]))}
    best = min(table, key=lambda f: table[f]["mean_abs"])
    for form, entry in sorted(table.items(), key=lambda kv: kv[1]["mean_abs"]):
        cells = "  ".join(f"{c['mean_abs']:.2%}" for c in entry["cells"].values())
        print(f"{form:22s} mean |error| {entry['mean_abs']:.3%}   ({cells})")
    print(f"best: {best}")
    out = {"ladders": list(ladders), "forms": table, "best": best,
           "score": "relative error of the end-of-run loss given the measured loss at the "
                    "switch; mean |error| over every ladder and split"}
    OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
