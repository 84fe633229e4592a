"""Is a compute multiplier honest? Train the base recipe at the compute the multiplier says
it needs, and see whether it lands on the variant's loss.

    python bench/compare_validate.py NAME [--seeds 1 2]

reads bench/results/NAME/NAME.json (written by bench/ladder_compare.py: base vs one variant),
takes the theoretical multiplier M at the variant's largest point (compute C, measured
loss L_v), and trains the base recipe's widest trunk rung again with its steps scaled so
that it spends M * C model FLOPs (same width, batch, schedule shape and seeds as the
rungs; only the steps change). The multiplier is honest when that run's loss lands on L_v
within the seed noise; the run at 1x (the base's own rung) shows the gap it had to close.
Nothing here is fitted to the outcome: M, C and the rung are fixed by the comparison.
Writes bench/results/NAME/NAME_validation.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_model  # noqa: E402

from moelab.config import config_from_dict, config_to_dict  # noqa: E402
from moelab.ladder.results import result, run_dir  # noqa: E402
from moelab.ladder.runner import ensure_trained  # noqa: E402
from moelab.ladder.spec import load_spec, merge  # noqa: E402
from moelab.train.metrics import flops_per_token  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a comparison under bench/results/ (NAME/NAME.json)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the base spec's seeds")
    args = parser.parse_args(argv)
    folder = RESULTS / args.name
    record = json.loads((folder / f"{args.name}.json").read_text())
    cmp = record["compare"]
    base_path, variant_path = record["specs"][:2]
    base, variant = load_spec(base_path), load_spec(variant_path)
    entry = cmp["variants"][variant.name]["theoretical"]
    c_v = entry["at"][0]["compute"]
    m, (m_lo, m_hi) = entry["value"], entry["interval"]
    point = min(cmp["recipes"][variant.name]["points"], key=lambda p: abs(p["compute"] - c_v))
    trunks = [r for r in base.rungs if r.parent is None]
    widest = max(r.config.model.d_model for r in trunks)
    seeds = args.seeds or sorted({r.seed for r in trunks})
    rungs, own = [], []
    for seed in seeds:
        rung = next(r for r in trunks if r.config.model.d_model == widest and r.seed == seed)
        own.append(result(rung, run_dir(base, rung)).final_val_loss)
        own_compute = rung.compute
        cfg = rung.config
        per_step = flops_per_token(cfg) * cfg.data.batch_size * cfg.data.seq_len
        steps = int(round(m * c_v / per_step))
        raw = merge(config_to_dict(cfg), {"train": {
            "steps": steps, "eval_every": max(steps // base.evals, 1),
            "keep_checkpoints": 2}})
        rungs.append(dataclasses.replace(rung, name=f"{rung.point or rung.name}-x{m:.2f}-s{seed}",
                                         config=config_from_dict(raw), point=""))
    spec = dataclasses.replace(base, out=Path("runs/ladder") / f"{args.name}_validation")
    print(f"[validate] {variant.name} at C={c_v:.3g}: loss {point['loss']:.4f}; theoretical "
          f"multiplier {m:.3f} [{m_lo:.3f}, {m_hi:.3f}] -> {base.name} d{widest} for "
          f"{rungs[0].config.train.steps} steps ({rungs[0].compute:.3g} FLOPs), seeds {seeds}",
          flush=True)
    started = time.time()
    runs = [ensure_trained(spec, r, "validation") for r in rungs]
    losses = [r.final_val_loss for r in runs]
    mean = float(np.mean(losses))
    seed_sd = cmp["recipes"][base.name]["seed_sd"]
    # the noise of the comparison: the validation's mean over its seeds and the variant's
    # point (a mean over the same number of seeds), each with its recipe's seed sd
    noise = float(np.hypot(seed_sd / np.sqrt(len(losses)), point["sd"]))
    out = {
        "command": "python bench/compare_validate.py " + " ".join(sys.argv[1:]),
        "comparison": f"bench/results/{args.name}/{args.name}.json", "cpu": cpu_model(),
        "variant": variant.name, "base": base.name,
        "variant_point": {"compute": c_v, "loss": point["loss"], "sd": point["sd"]},
        "multiplier": {"value": m, "interval": [m_lo, m_hi]},
        "base_at_1x": {"compute": own_compute, "d_model": widest, "losses": own,
                       "mean": float(np.mean(own))},
        "base_at_multiplier": {"d_model": widest, "steps": rungs[0].config.train.steps,
                               "compute": rungs[0].compute, "runs": [r.name for r in rungs],
                               "losses": losses, "mean": mean},
        "difference": {"nats": mean - point["loss"],
                       "relative": (mean - point["loss"]) / point["loss"],
                       "noise_sd_nats": noise,
                       "within_2_sd": abs(mean - point["loss"]) <= 2 * noise,
                       "gap_at_1x_nats": float(np.mean(own)) - point["loss"]},
        "wall_s": time.time() - started,
    }
    (folder / f"{args.name}_validation.json").write_text(json.dumps(out, indent=1) + "\n")
    # and in the comparison's own file: what the multiplier predicted against what came out
    record["validation"] = {
        "predicted": point["loss"], "measured": mean,
        "relative_error": out["difference"]["relative"],
        "within_2_sd": out["difference"]["within_2_sd"],
        "what": f"{base.name} trained at {m:.3f}x the compute of {variant.name}'s point at "
                f"C={c_v:.3g} is predicted to reach that point's loss",
        "detail": f"bench/results/{args.name}/{args.name}_validation.json"}
    (folder / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    d = out["difference"]
    print(f"[validate] {base.name} at {m:.2f}x: loss {mean:.4f} vs {variant.name} "
          f"{point['loss']:.4f}: {d['nats']:+.4f} nats ({100 * d['relative']:+.2f}%), noise sd "
          f"{noise:.4f}; at 1x the gap was {d['gap_at_1x_nats']:+.4f} nats", flush=True)
    print(f"wrote {folder / args.name}_validation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
