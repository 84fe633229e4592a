"""What a mid-training data switch is worth: the tiny preset with its last 20% up-weighting
one source 3x, against the same run without the switch, in compute.

    python3 bench/stage_study.py [--source prose] [--seeds 2] [--factors 1,1.25,1.5,2]

Per seed: one staged run (stage 0 on the by-size mixture, then from 80% of the steps the
source's weight x3) and no-switch runs of the same recipe at `factors` x the steps (each a
whole WSD schedule of its own length, so each ends decayed, as the staged run does). All
are scored on the whole validation split of every source (the ladder's evaluator). The
switch's worth on the up-weighted source is the number of steps the no-switch recipe needs
to reach the staged run's loss on it (interpolated linearly in log steps between the two
no-switch runs around it), over the staged run's steps: a compute multiplier, with what the
switch cost on the other sources beside it. Results: bench/results/stage_study/stage_study.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import cpu_model, run_main  # bench/machine.py

from moelab.config import config_from_dict, config_to_dict, data_dir, load_config
from moelab.data.loader import read_meta, resolve_mixture
from moelab.ladder.evaluate import make_evaluator
from moelab.train.cli import config_path
from moelab.train.trainer import prepared_data, train

RESULTS = Path(__file__).parent / "results" / "stage_study" / "stage_study.json"
SWITCH = 0.8  # the last 20% of the steps


def config(base: dict, steps: int, seed: int, upweight: dict | None) -> object:
    raw = json.loads(json.dumps(base))
    raw["train"].update(steps=steps, seed=seed, eval_every=steps, checkpoint_every=steps,
                        log_every=max(steps // 4, 1))
    raw["stages"] = ([] if upweight is None else
                     [{"name": "pretrain", "mixture": {}},
                      {"name": "upweight", "start": SWITCH, "mixture": upweight}])
    return config_from_dict(raw)


def final_losses(cfg, out: Path, name: str) -> dict[str, float]:
    """Train in a fresh run dir; {source: val loss over the whole split} at the end."""
    record = train(cfg, out / name, evaluator=make_evaluator(cfg))
    return {k.split("/", 1)[1]: float(v) for k, v in record.items()
            if k.startswith("val_loss/")}


def steps_to_reach(target: float, steps: list[int], losses: list[float]) -> float | None:
    """Steps at which the no-switch curve (final loss vs steps, falling) reaches `target`,
    linear in log steps between the bracketing runs; None outside the measured range."""
    for i in range(len(steps) - 1):
        (s0, l0), (s1, l1) = (steps[i], losses[i]), (steps[i + 1], losses[i + 1])
        if l0 >= target >= l1 and l0 != l1:
            t = (l0 - target) / (l0 - l1)
            return float(np.exp(np.log(s0) + t * (np.log(s1) - np.log(s0))))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="prose", help="the source up-weighted 3x")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--factors", default="1,1.25,1.5,2",
                        help="no-switch runs at these multiples of the staged run's steps")
    parser.add_argument("--steps", type=int, default=None, help="default: the tiny preset's")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    base_cfg = load_config(config_path("tiny"))
    prepared_data(base_cfg)  # the default corpus, prepared where `moelab train` puts it
    base = config_to_dict(base_cfg)
    steps = args.steps or base_cfg.train.steps
    meta = read_meta(data_dir(base_cfg.data.path))
    if args.source not in meta["sources"]:
        raise SystemExit(f"--source {args.source!r}: the corpus has {meta['sources']}")
    by_size = dict(zip(meta["sources"], resolve_mixture(meta, "train", {}).weights.tolist(),
                       strict=True))
    upweight = {s: w * (3.0 if s == args.source else 1.0) for s, w in by_size.items()}
    factors = sorted(float(f) for f in args.factors.split(","))
    started = time.perf_counter()
    seeds = []
    out = Path(tempfile.mkdtemp(prefix="stage-study-"))
    try:
        for seed in range(args.seeds):
            staged = final_losses(config(base, steps, seed, upweight), out, f"staged-{seed}")
            plain = {}
            for f in factors:
                n = int(round(f * steps))
                plain[n] = final_losses(config(base, n, seed, None), out, f"plain-{n}-{seed}")
            ns = sorted(plain)
            reach = steps_to_reach(staged[args.source], ns, [plain[n][args.source] for n in ns])
            row = {"seed": seed, "staged": staged, "no_switch": {str(n): plain[n] for n in ns},
                   "steps_no_switch_needs_for_staged_loss": reach,
                   "multiplier": None if reach is None else reach / steps,
                   "other_sources_change": {s: staged[s] - plain[steps][s]
                                            for s in staged if s != args.source}}
            print(json.dumps(row), flush=True)
            seeds.append(row)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    multipliers = [r["multiplier"] for r in seeds]
    known = [m for m in multipliers if m is not None]
    result = {
        "what": f"tiny preset, last {1 - SWITCH:.0%} with {args.source} x3 vs no switch; "
                "compute multiplier on the up-weighted source",
        "source": args.source, "steps": steps, "switch_at": SWITCH, "factors": factors,
        "by_size": by_size, "upweighted_mixture": upweight, "seeds": seeds,
        "multiplier_mean": float(np.mean(known)) if known else None,
        "multiplier_sd": float(np.std(known, ddof=1)) if len(known) > 1 else None,
        "multiplier_outside_range": len(known) < len(multipliers),
        "cpu": cpu_model(), "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "seeds"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main)
