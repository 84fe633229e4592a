"""Horizon transfer, measured: does the loss-minimising LR move with the tokens a run trains?

    moelab data prepare --preset ladder                 # once (the held-out specs' corpus)
    python3 bench/horizon_transfer.py [--spec h6_isoflop_16x_v6] [--width 32]
                                      [--steps 600 2400] [--factors 0.5 0.71 1 1.41 2]

A ladder's rungs and its target share one LR (scaled only by width, `optim.lr_base_width`),
but the target trains 3-8x the tokens of the rungs' longest. Published sweeps put the
optimum LR lower for longer runs (Bjorck et al. 2024, "Scaling Optimal LR Across Token
Horizons"; Marin's fitted rule, adam_lr ~ tokens^-0.28; Delphi's 30x ladder diverged until
its LR was corrected for the token horizon). If that holds here, a target run at the
rungs' LR sits above its law in the stable phase and gains more than the rungs in its
decay: what the held-out ladders h2-h7 show (docs/ladder-heldout.md).

One width of the spec (a rung's, default d_model 32) trains at each of `--steps` with the
spec's recipe (its stage plan at the same fractions, its first seed) at the spec's LR
times each of `--factors`, scored on the whole validation split at the end. Runs live in
runs/horizon_transfer/<spec>/ and a finished one is only read. Writes
bench/results/horizon_transfer/horizon_transfer.json: per horizon its steps and tokens,
each factor's final loss, the optimum on the grid and between its points (a parabola in
log LR through the best three, as bench/width_transfer.py), and `optimum_tokens_power`,
the least-squares power of the interpolated optimum in tokens (0: the LR transfers over
horizons; Marin's rule -0.28).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from machine import add_output_args, quiet_start, run_main, write_result
from width_transfer import probe, vertex

from moelab.errors import UserError
from moelab.ladder.runner import ensure_trained
from moelab.ladder.spec import LadderSpec, Rung, load_spec

RESULTS = Path(__file__).parent / "results" / "horizon_transfer" / "horizon_transfer.json"
FACTORS = (0.5, 0.71, 1.0, 1.41, 2.0)


def tokens_power(horizons: list[dict]) -> float | None:
    """The slope of ln(interpolated optimum factor) on ln(tokens), least squares over the
    horizons whose optimum lies between grid points (None with fewer than two)."""
    pts = [(math.log(h["tokens"]), math.log(h["optimum_factor_interpolated"]))
           for h in horizons if h["optimum_factor_interpolated"]]
    if len(pts) < 2:
        return None
    return float(np.polyfit(*zip(*pts, strict=True), 1)[0])


def sweep(spec: LadderSpec, width: int, steps: list[int], factors: tuple[float, ...],
          out: Path) -> dict:
    trunks = [r for r in spec.rungs if r.parent is None]
    base = next((r for r in trunks if r.config.model.d_model == width), None)
    if base is None:
        raise UserError(f"{spec.name} has no rung of d_model {width} (its rungs: "
                        f"{sorted({r.config.model.d_model for r in trunks})})")
    spec = LadderSpec(spec.name, out, spec.rungs, spec.target, spec.fit)  # runs go to `out`
    lr = base.config.optim.lr
    horizons = []
    for n in steps:
        runs = []
        for f in factors:
            rung = Rung(f"d{width}-s{n}-lr{f:g}", probe(base.config, n, lr * f))
            loss = ensure_trained(spec, rung, f"{n} steps, lr x{f:g}").final_val_loss
            runs.append({"factor": f, "lr": lr * f, "final_val_loss": loss})
        best = min(runs, key=lambda r: r["final_val_loss"])
        horizons.append({"steps": n, "tokens": rung.tokens, "runs": runs,
                         "optimum_factor": best["factor"],
                         "optimum_factor_interpolated": vertex(runs)})
    return {"spec": spec.name, "d_model": width, "lr": lr, "factors": list(factors),
            "horizons": horizons, "optimum_tokens_power": tokens_power(horizons),
            "published": {"marin_adam_lr_tokens_power": -0.2813}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="h6_isoflop_16x_v6",
                        help="ladder spec (file or preset name) whose recipe to use")
    parser.add_argument("--width", type=int, default=32, help="d_model of the spec's rung")
    parser.add_argument("--steps", type=int, nargs="+", default=[600, 2400],
                        help="the horizons, in steps")
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS),
                        help="LR multipliers of the spec's LR")
    parser.add_argument("--runs", type=Path, default=None,
                        help="run directories (default runs/horizon_transfer/<spec>)")
    add_output_args(parser, RESULTS)
    args = parser.parse_args()
    spec = load_spec(args.spec)
    before = quiet_start(args.force)
    out = write_result(args.out, sweep(spec, args.width, sorted(args.steps),
                                       tuple(sorted(args.factors)),
                                       args.runs or Path("runs/horizon_transfer") / spec.name),
                       before)
    for h in out["horizons"]:
        losses = ", ".join(f"x{r['factor']:g} {r['final_val_loss']:.4f}" for r in h["runs"])
        print(f"{h['steps']} steps ({h['tokens']:,} tokens): {losses}; optimum "
              f"x{h['optimum_factor']:g} (between the points: "
              f"{h['optimum_factor_interpolated']})")
    print(f"the optimum LR scales as tokens^{out['optimum_tokens_power']} (Marin's rule: "
          f"^-0.28) -> {args.out}")


if __name__ == "__main__":
    run_main(main)
