"""How wide will a measured-repetition ladder's interval be at its target, before training
it? The design study behind repetition_v4 (issue 47).

    python3 bench/repetition_design.py      # reads kept reports, trains nothing (~2 min)

fit.precision refuses a target whose 90% interval is wider than +-4.9%, and repetition_v3's
was +-15%. To choose the next spec's rungs without looking at any target's loss, this
takes the law fitted on repetition_v3's 18 rungs (moelab.ladder.overfit) as the truth,
simulates each candidate spec's rung losses from it with v3's rung residual (its rmse) as
Gaussian noise, refits the law, and reads the delta-method half-width at the candidate's
target, over `--draws` noise draws. It says how well a design pins the law's parameters if
the law were right; it cannot say whether the law is right at the target (that is what the
run measures), and it never reads a target's actual loss.

Candidates are ladder specs (their rungs' N, tokens and passes as `moelab ladder plan`
computes them): repetition_v3 itself, repetition_v4, and the alternatives considered for
v4, written as rung lists below. Writes
bench/results/repetition_design/repetition_design.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
from machine import run_main  # bench/machine.py

from moelab.ladder import repetition
from moelab.ladder.overfit import fit_overfit
from moelab.ladder.spec import LADDER_PRESETS, load_spec
from moelab.train.metrics import active_params

HERE = Path(__file__).parent / "results"
V3 = HERE / "ladder_repetition" / "repetition_v3" / "report.json"
RESULTS = HERE / "repetition_design" / "repetition_design.json"
# (unique tokens, passes) per data cell; a rung is (width, unique tokens, passes)
V3_CELLS = [(800e3, 1), (400e3, 1), (400e3, 2), (400e3, 4), (200e3, 2), (200e3, 4)]
V4_CELLS = [(800e3, 1), (400e3, 1), (400e3, 2), (200e3, 2), (200e3, 4)]


def grid(widths, cells, extra=()):
    return [(w, u, p) for u, p in cells for w in widths] + list(extra)


# the alternatives weighed for v4 (its target: d_model 224, 2.5 passes over 1.3M tokens)
ALTERNATIVES = {
    "v3 rungs plus width 96, no 4-pass rungs on 400K":
        grid((32, 48, 64, 96), V3_CELLS[:3] + V3_CELLS[4:]),
    "v4 rungs plus 4-pass rungs on 400K at widths 32, 48":
        grid((32, 48, 64, 96, 128), V4_CELLS, [(32, 400e3, 4), (48, 400e3, 4)]),
    "v4 rungs without width 48": grid((32, 64, 96, 128), V4_CELLS),
}
V4_TARGET = (224, 1.3e6, 2.5)


def spec_points(name: str):
    """A spec's rungs and target as (N, tokens, passes) arrays, as the ladder places them."""
    spec = load_spec(LADDER_PRESETS / "dev" / f"{name}.yaml")
    rows = [(r.active_params, r.tokens, repetition.most_passes(r)) for r in spec.rungs]
    t = spec.target
    return np.array(rows, float), (t.active_params, t.tokens, repetition.most_passes(t)), \
        spec.target.compute / max(r.compute for r in spec.rungs)


@functools.cache
def _v4_config():
    return load_spec(LADDER_PRESETS / "dev" / "repetition_v4.yaml").rungs[0].config


@functools.cache
def active(width: int) -> int:
    """Active parameters of repetition_v4's model at d_model = d_ff = width, as the ladder
    counts them (moelab.train.metrics.active_params)."""
    base = _v4_config()
    model = dataclasses.replace(base.model, d_model=width, d_ff=width)
    return active_params(dataclasses.replace(base, model=model))


def grid_points(rungs, target):
    rows = [(active(w), u * p, p) for w, u, p in rungs]
    tw, tu, tp = target
    t = (active(tw), tu * tp, tp)
    return np.array(rows, float), t, (t[0] * t[1]) / max(n * d for n, d, _ in rows)


def half_widths(truth, rows, target, sd: float, draws: int, seed: int) -> dict:
    mu = truth.predict(rows[:, 0], rows[:, 1], rows[:, 2])
    rng = np.random.default_rng(seed)
    out, failed = [], 0
    for _ in range(draws):
        try:
            fit = fit_overfit(rows[:, 0], rows[:, 1], rows[:, 2], mu + rng.normal(0, sd, len(mu)))
        except Exception:  # noqa: BLE001 - a draw the law cannot fit is counted, not fatal
            failed += 1
            continue
        iv = fit.interval(*target)
        out.append(max(iv["high"] - iv["value"], iv["value"] - iv["low"]) / iv["value"])
    q = np.percentile(out, [50, 80]) if out else [float("nan")] * 2
    return {"median_half_width": float(q[0]), "p80_half_width": float(q[1]),
            "draws": len(out), "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    v3 = json.loads(V3.read_text())
    m = v3["repetition_measured"]
    truth = fit_overfit(*(np.array([p[k] for p in v3["points"]], float)
                          for k in ("active_params", "tokens")),
                        spec_points("repetition_v3")[0][:, 2],
                        np.array([p["mean"] for p in v3["points"]], float))
    sd = m["rmse"]
    print(f"truth: the law on repetition_v3's {m['n']} rungs (P {truth.P:.3f}, rmse {sd:.4f})")
    designs = {}
    for name in ("repetition_v3", "repetition_v4"):
        designs[name] = spec_points(name)
    for name, rungs in ALTERNATIVES.items():
        designs[name] = grid_points(rungs, V4_TARGET)
    results = []
    for name, (rows, target, ratio) in designs.items():
        hw = half_widths(truth, rows, target, sd, args.draws, seed=0)
        results.append({"design": name, "rungs": len(rows), "compute_ratio": ratio,
                        "target": {"active_params": target[0], "tokens": target[1],
                                   "passes": target[2]}, **hw})
        print(f"{name:55s} {len(rows):3d} rungs  {ratio:5.1f}x  half-width median "
              f"{hw['median_half_width']:.1%}  p80 {hw['p80_half_width']:.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "kind": "moelab.repetition_design/1", "truth": "repetition_v3's fitted law",
        "noise_sd": sd, "draws": args.draws, "precision_limit": 0.049,
        "designs": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
