"""Which law predicts a stage's end from the rungs alone: a rung-only backtest on a
finished staged ladder (configs/ladder/dev/staged.yaml version 1 chose its stage law by it).

    git show e61e049:configs/ladder/staged.yaml > /tmp/staged_v1.yaml   # version 1
    PYTHONPATH=src python bench/stage_law_backtest.py /tmp/staged_v1.yaml

The rungs' losses at their end of the first stage sit at three steps per width (the two
branches' and the trunk's switch). Fitted on the two earlier ends of every width, each law
predicts the latest: L(N, D) on those stage-end losses, and the curve law on every rung
evaluation whose lr-weighted tokens S1 reach no further than the second end's. Prints and
writes bench/results/stage_law_backtest/stage_law_backtest.json: each law's relative error
per width.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from moelab.ladder.curve import schedule_areas
from moelab.ladder.fit import fit_chinchilla, fit_curve
from moelab.ladder.predict import _curve_points, _loss_at, stage_ends
from moelab.ladder.runner import finished_rungs
from moelab.ladder.spec import load_spec

OUT = Path(__file__).parent / "results" / "stage_law_backtest" / "stage_law_backtest.json"


def backtest(spec) -> dict:
    results, _ = finished_rungs(spec)
    by_name, rungs = {r.name: r for r in results}, {r.name: r for r in spec.rungs}
    rows = []
    for runs in spec.points().values():
        _, _, end, tokens = stage_ends(runs[0])[0]
        loss = np.mean([_loss_at(by_name[r.name], rungs[r.name], end, by_name) for r in runs])
        rows.append((runs[0].active_params, tokens, end, loss))
    rows = np.array(rows, float)
    ends = sorted(set(rows[:, 2]))
    fit, held = rows[:, 2] < ends[-1], rows[:, 2] == ends[-1]
    nd = fit_chinchilla(rows[fit, 0], rows[fit, 1], rows[fit, 3])
    chinchilla = (nd.predict(rows[held, 0], rows[held, 1]) - rows[held, 3]) / rows[held, 3]
    c = _curve_points(spec, results)
    cn, cs1, cs2, cy = (np.array(c[k], float) for k in ("n", "s1", "s2", "loss"))
    s1, _ = schedule_areas(spec.rungs[0].config)
    early = cs1 <= s1[int(ends[-2])] + 1e-9
    cf = fit_curve(cn[early], cs1[early], cs2[early], cy[early], form=spec.fit.curve_law)
    scored = np.isclose(cs1, s1[int(ends[-1])]) & (cs2 == 0)
    curve = (cf.predict(cn[scored], cs1[scored], cs2[scored]) - cy[scored]) / cy[scored]
    return {"ladder": spec.name, "fitted_ends": ends[:-1], "predicted_end": ends[-1],
            "widths_active_params": rows[held, 0].tolist(),
            "relative_error": {"chinchilla": chinchilla.tolist(), "curve": curve.tolist()},
            "mean_abs": {"chinchilla": float(np.abs(chinchilla).mean()),
                         "curve": float(np.abs(curve).mean())}}


def main() -> None:
    spec = load_spec(sys.argv[1] if len(sys.argv) > 1 else "staged")
    out = backtest(spec)
    print(json.dumps(out, indent=1))
    OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
