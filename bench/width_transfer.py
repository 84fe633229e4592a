"""Width transfer, measured: short LR sweeps at a ladder's narrowest rung width and at its
target width, each optimum beside the LR the muP-style rule (`optim.lr_base_width`) uses.

    moelab data prepare --preset ladder                 # once (the held-out specs' corpus)
    python3 bench/width_transfer.py [--spec h1_two_stage_30x] [--steps 600]
                                    [--rung-widths 56 88] [--force]

The rule keeps one base LR at every width and scales the matrices' updates by
lr_base_width / d_model; if it transfers, the loss-minimising LR factor is the same at both
widths (ideally 1: the spec's own LR). Each width trains `--steps` steps with the spec's
recipe (its stage plan at the same fractions, its first seed) at the rule's LR times each
of `--factors`, scored on the whole validation split at the end (the ladder's evaluator).
Runs live in runs/width_transfer/<spec>/ and a finished one is only read. Writes
bench/results/width_transfer/width_transfer.json: per width its d_model, the rule's LR and
matrix LR, each LR's final loss, the optimum and its factor against the rule; and
`optimum_factor_ratio` (target's optimum factor over the narrow rung's: 1 when the rule
transfers), on the grid and between its points (a parabola in log LR through the best
three, `optimum_factor_ratio_interpolated`). `--rung-widths` adds the spec's rungs of those
widths, and `optimum_matrix_lr_power` fits the optimum's power in d_model over them all
(the rule's is -1). 2 widths x 5 LRs of 600 steps took 46 min on
2 cores (2026-12-06, AMD EPYC): the d_model-192 runs ~7 min each.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from machine import add_output_args, quiet_start, run_main, write_result  # bench/machine.py

from moelab.config import Config, config_from_dict, config_to_dict
from moelab.ladder.runner import ensure_trained
from moelab.ladder.spec import LadderSpec, Rung, load_spec, merge
from moelab.train.optimizer import width_factor

RESULTS = Path(__file__).parent / "results" / "width_transfer" / "width_transfer.json"
FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


def probe(config: Config, steps: int, lr: float) -> Config:
    """`config` shortened to `steps` (scored once at the end) at base LR `lr`."""
    return config_from_dict(merge(config_to_dict(config), {
        "train": {"steps": steps, "eval_every": steps, "checkpoint_every": steps,
                  "keep_checkpoints": 1},
        "optim": {"lr": lr}}))


def vertex(runs: list[dict]) -> float | None:
    """The loss-minimising LR factor between the grid's points: the vertex of the parabola
    in log2(factor) through the best run and its two neighbours (None at the grid's edge,
    where the optimum may lie outside it, or when the three do not curve upward)."""
    i = min(range(len(runs)), key=lambda k: runs[k]["final_val_loss"])
    if i in (0, len(runs) - 1):
        return None
    x = [math.log2(runs[k]["factor"]) for k in (i - 1, i, i + 1)]
    y = [runs[k]["final_val_loss"] for k in (i - 1, i, i + 1)]
    a, b, _ = np.polyfit(x, y, 2)
    return float(2 ** (-b / (2 * a))) if a > 0 else None


def power(widths: list[dict]) -> tuple[float, float] | None:
    """(slope, intercept) of ln(optimum factor) on ln(d_model), least squares over the
    widths whose optimum lies between grid points: slope 0 when the rule transfers; the
    optimum matrix LR then scales as d_model^(slope - 1), the rule's being d_model^-1."""
    pts = [(math.log(w["d_model"]), math.log(w["optimum_factor_interpolated"]))
           for w in widths if w["optimum_factor_interpolated"]]
    if len(pts) < 2:
        return None
    slope, intercept = np.polyfit(*zip(*pts, strict=True), 1)
    return float(slope), float(intercept)


def fitted_rule(fit: tuple[float, float] | None, base_width: int) -> dict | None:
    """The optim settings whose matrix LR follows the fitted optima at the spec's own lr:
    lr (B / d)^p = lr e^c base d^(s-1) gives p = 1 - s and B = (e^c base)^(1/p). The sweep
    scales the embedding's LR with the matrices'; the rule leaves it at lr."""
    if fit is None or fit[0] >= 1.0:
        return None
    p = 1.0 - fit[0]
    return {"lr_width_power": round(p, 2),
            "lr_base_width": round((math.exp(fit[1]) * base_width) ** (1.0 / p))}


def sweep(spec: LadderSpec, steps: int, factors: tuple[float, ...], out: Path,
          rung_widths: tuple[int, ...] = ()) -> dict:
    """The widths' sweeps and their optima (see the module docstring)."""
    trunks = [r for r in spec.rungs if r.parent is None]
    narrow = min(trunks, key=lambda r: r.config.model.d_model)
    middle = []
    for d in rung_widths:
        rung = next((r for r in trunks if r.config.model.d_model == d), None)
        if rung is None:
            raise SystemExit(f"error: {spec.name} has no rung of d_model {d} (its rungs: "
                             f"{sorted({r.config.model.d_model for r in trunks})})")
        middle.append(("rung", rung))
    spec = LadderSpec(spec.name, out, spec.rungs, spec.target, spec.fit)  # runs go to `out`
    widths = []
    for label, base in (("narrowest_rung", narrow), *middle, ("target", spec.target)):
        d, lr = base.config.model.d_model, base.config.optim.lr
        runs = []
        for f in factors:
            rung = Rung(f"{label}-d{d}-lr{f:g}", probe(base.config, steps, lr * f))
            loss = ensure_trained(spec, rung, f"{label} lr x{f:g}").final_val_loss
            runs.append({"factor": f, "lr": lr * f,
                         "matrix_lr": lr * f * width_factor(base.config.optim, d),
                         "final_val_loss": loss})
        best = min(runs, key=lambda r: r["final_val_loss"])
        widths.append({"role": label, "d_model": d, "rule_lr": lr,
                       "rule_matrix_lr": lr * width_factor(base.config.optim, d),
                       "runs": runs, "optimum_lr": best["lr"], "optimum_factor": best["factor"],
                       "optimum_factor_interpolated": vertex(runs),
                       "rule_is_optimum": best["factor"] == 1.0})
    ends = [widths[0]["optimum_factor_interpolated"], widths[-1]["optimum_factor_interpolated"]]
    fit = power(widths)
    slope = None if fit is None else fit[0]
    return {"spec": spec.name, "steps": steps, "factors": list(factors), "widths": widths,
            "optimum_factor_ratio": widths[-1]["optimum_factor"] / widths[0]["optimum_factor"],
            "optimum_factor_ratio_interpolated": None if None in ends else ends[1] / ends[0],
            "optimum_factor_power": slope,
            "optimum_matrix_lr_power": None if slope is None else slope - 1.0,
            "rule_matrix_lr_power": -1.0,
            "fitted_rule": fitted_rule(fit, spec.target.config.optim.lr_base_width)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="h1_two_stage_30x",
                        help="ladder spec (file or preset name) whose recipe and widths to use")
    parser.add_argument("--steps", type=int, default=600, help="steps of each sweep run")
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS),
                        help="LR multipliers of the rule's LR")
    parser.add_argument("--rung-widths", type=int, nargs="+", default=[],
                        help="also sweep the spec's rungs of these d_model (between the two)")
    parser.add_argument("--runs", type=Path, default=None,
                        help="run directories (default runs/width_transfer/<spec>)")
    add_output_args(parser, RESULTS)
    args = parser.parse_args()
    spec = load_spec(args.spec)
    before = quiet_start(args.force)
    out = write_result(args.out, sweep(spec, args.steps, tuple(args.factors),
                                       args.runs or Path("runs/width_transfer") / spec.name,
                                       tuple(args.rung_widths)), before)
    for w in out["widths"]:
        losses = ", ".join(f"x{r['factor']:g} {r['final_val_loss']:.4f}" for r in w["runs"])
        print(f"{w['role']} d_model {w['d_model']}: {losses}; optimum x{w['optimum_factor']:g} "
              f"(lr {w['optimum_lr']:.3g}; the rule's {w['rule_lr']:.3g})")
    print(f"optimum factor, target over narrowest rung: {out['optimum_factor_ratio']:g} on the "
          f"grid, {out['optimum_factor_ratio_interpolated']} between its points; the optimum "
          f"matrix LR scales as d_model^{out['optimum_matrix_lr_power']} (the rule: ^-1); "
          f"the optim settings that follow the optima: {out['fitted_rule']} -> {args.out}")


if __name__ == "__main__":
    run_main(main)
