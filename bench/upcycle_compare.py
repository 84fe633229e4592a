"""Upcycled vs from scratch at equal total compute, priced as a compute multiplier.

    python bench/upcycle_compare.py [--dense-steps 400] [--moe-steps 400]

The from-scratch arm is the ladder configs/ladder/dev/upcycle_scratch.yaml (8 experts
top-1, each expert as wide as the dense FFN), trained and read as `moelab ladder compare`
does. The upcycled arm, per trunk width and seed of configs/ladder/dev/dense.yaml:

1. a dense trunk trained `dense_steps / (1 - decay_fraction)` steps, so that its
   step-`dense_steps` checkpoint sits at the end of the constant-lr phase (as the dense
   ladder's own trunk would be there);
2. `moelab upcycle` of that checkpoint (8 experts, top-1, the seed's noise and router);
3. that MoE trained `moe_steps` steps under its own schedule and scored on the whole val
   split as every ladder run is (moelab.ladder.evaluate).

Its point is (the dense trunk's FLOPs up to the upcycled step + the MoE run's FLOPs, the
MoE run's final val loss): the dense steps are counted, as the issue asks. The MoE stage
draws its batches with data.seed + 1000: a batch is a function of (seed, step) and the
upcycled run restarts at step 0, so with the trunk's seed it would re-read the trunk's
first batches in order. Both arms' points then go through the same joint fit and
bootstrap as `ladder compare` (moelab.ladder.compare.compare_recipes), so the multiplier
is the compute the scratch recipe needs to reach the upcycled loss over the upcycled
run's compute, with an interval. Writes bench/results/compare_upcycle/compare_upcycle.json,
.md and .png. Train on a quiet machine: the realized (wall-clock) multiplier uses the
logged throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_model, load_per_core, run_main  # noqa: E402

from moelab.config import config_from_dict, config_to_dict, load_config  # noqa: E402
from moelab.lab.store import Store, default_lab_path  # noqa: E402
from moelab.ladder.compare import (  # noqa: E402
    Recipe,
    _data_identity,
    _tokens_per_s,
    compare_recipes,
    markdown,
    plot,
    recipe_from_spec,
    record_in_lab,
    train_rungs,
)
from moelab.ladder.predict import pooled_sd  # noqa: E402
from moelab.ladder.results import FINAL_LOSS, is_finished, timings  # noqa: E402
from moelab.ladder.runner import ensure_trained  # noqa: E402
from moelab.ladder.spec import Rung, load_spec, merge, stable_end  # noqa: E402
from moelab.train.metrics import flops_per_token  # noqa: E402

NAME = "compare_upcycle"
RESULTS = Path(__file__).parent / "results" / NAME
SCRATCH = "configs/ladder/dev/upcycle_scratch.yaml"
DENSE = "configs/ladder/dev/dense.yaml"
EXPERTS, TOP_K = 8, 1
DATA_SEED_SHIFT = 1000
QUESTION = "Upcycled vs from scratch at equal total compute"
HYPOTHESIS = ("At equal total compute (the dense steps counted) the upcycled MoE reaches a "
              "lower loss than the one trained from scratch, worth about 1.1x its compute at "
              "the 800-step trunk (configs/ladder/dev/upcycle_scratch.yaml, written before "
              "any run)")


def with_fields(config, fields: dict) -> object:
    return config_from_dict(merge(config_to_dict(config), fields))


def trunk_rung(rung: Rung, dense_steps: int) -> Rung:
    """The dense trunk, long enough that step `dense_steps` ends its constant-lr phase."""
    steps = round(dense_steps / (1 - rung.config.optim.decay_fraction))
    cfg = with_fields(rung.config, {"train": {"steps": steps, "eval_every": steps // 10,
                                              "checkpoint_every": dense_steps,
                                              "keep_checkpoints": 3}})
    if stable_end(cfg) != dense_steps:
        raise SystemExit(f"{rung.name}: a {steps}-step trunk's decay starts at "
                         f"{stable_end(cfg)}, not {dense_steps}; pick other --dense-steps")
    return Rung(name=f"dense-{rung.name}", config=cfg, point=f"dense-{rung.point}")


def upcycled_rung(spec, trunk: Rung, dense_steps: int, moe_steps: int) -> Rung:
    """Upcycle the trunk's checkpoint once (its run dir written by `moelab upcycle`), and
    return the MoE run as a rung whose config is the one written there."""
    from moelab.train.upcycle import upcycle_run

    name = trunk.name.replace("dense-", "up-", 1)
    path = spec.out / name
    if not (path / "config.yaml").exists():
        seed = trunk.config.train.seed
        upcycle_run(spec.out / trunk.name, path, EXPERTS, TOP_K, step=dense_steps, seed=seed,
                    overrides={"train.steps": moe_steps, "train.eval_every": moe_steps // 10,
                               "train.checkpoint_every": moe_steps, "train.keep_checkpoints": 2,
                               "data.seed": seed + DATA_SEED_SHIFT})
    return Rung(name=name, config=load_config(path / "config.yaml"),
                point=trunk.point.replace("dense-", "up-", 1))


def upcycled_recipe(spec, pairs: list[tuple[Rung, Rung]], dense_steps: int,
                    data: str) -> tuple[Recipe, list[dict]]:
    """The upcycled arm's points: per width, mean final loss over seeds at the total
    compute (dense trunk's first dense_steps + the MoE run), and its wall-clock from each
    part's logged throughput."""
    from moelab.ladder.results import result

    rows: dict[str, dict] = {}
    for trunk, moe in pairs:
        d = trunk.config.data
        dense_tokens = dense_steps * d.batch_size * d.seq_len
        c_dense = flops_per_token(trunk.config) * dense_tokens
        done = result(moe, spec.out / moe.name)
        seconds = (dense_tokens / _tokens_per_s(spec.out / trunk.name)
                   + moe.tokens / _tokens_per_s(spec.out / moe.name))
        row = rows.setdefault(moe.point, {"point": moe.point, "runs": [], "losses": [],
                                          "compute": c_dense + moe.compute,
                                          "dense_compute": c_dense, "moe_compute": moe.compute,
                                          "seconds": [], "tokens": dense_tokens + moe.tokens})
        row["runs"].append(moe.name)
        row["losses"].append(done.final_val_loss)
        row["seconds"].append(seconds)
    table = list(rows.values())
    seed_sd, _ = pooled_sd([r["losses"] for r in table])
    c = np.array([r["compute"] for r in table])
    secs = np.array([np.median(r["seconds"]) for r in table])
    n = np.array([len(r["losses"]) for r in table], float)
    recipe = Recipe(name="upcycled", metric=FINAL_LOSS, data=data, compute=c, seconds=secs,
                    loss=np.array([np.mean(r["losses"]) for r in table]),
                    point_sd=seed_sd / np.sqrt(n), seed_sd=seed_sd,
                    tokens_per_s=np.array([r["tokens"] for r in table]) / secs)
    return recipe, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense-steps", type=int, default=400)
    parser.add_argument("--moe-steps", type=int, default=400)
    parser.add_argument("--out", default="runs/ladder/upcycle",
                        help="where the dense trunks and upcycled runs live")
    parser.add_argument("--no-lab", action="store_true",
                        help="do not record the comparison in the lab ($MOELAB_LAB, else "
                             "runs/lab.sqlite)")
    args = parser.parse_args(argv)
    scratch, dense = load_spec(SCRATCH), load_spec(DENSE)
    spec = dataclasses.replace(dense, name="upcycle", out=Path(args.out))
    experiment = None
    if not args.no_lab:  # the question and hypothesis as committed in the scratch spec
        with Store(default_lab_path()) as store:
            experiment = store.new_experiment(QUESTION, HYPOTHESIS,
                                              {"compare": [SCRATCH, DENSE]}, None)
    load_before, started = load_per_core(), time.time()
    train_rungs([scratch])
    pairs = []
    for rung in (r for r in dense.rungs if r.parent is None):
        trunk = trunk_rung(rung, args.dense_steps)
        ensure_trained(spec, trunk, "dense trunk")
        moe = upcycled_rung(spec, trunk, args.dense_steps, args.moe_steps)
        if not is_finished(moe, spec.out / moe.name):
            ensure_trained(spec, moe, "upcycled")
        pairs.append((trunk, moe))
    base = recipe_from_spec(scratch)
    variant, table = upcycled_recipe(spec, pairs, args.dense_steps, _data_identity(scratch))
    f = scratch.fit
    result = compare_recipes([base, variant], None, None, f.bootstrap, f.confidence, f.seed)
    wall = time.time() - started
    if experiment:
        record_in_lab(result, spec.out, experiment)
        with Store(default_lab_path()) as store:
            t, r = result["theoretical"], result["realized"]
            store.finish_experiment(experiment, "succeeded", (
                f"upcycled vs scratch: theoretical {t['value']:.3f}x [{t['interval'][0]:.3f}, "
                f"{t['interval'][1]:.3f}], realized {r['value']:.3f}x [{r['interval'][0]:.3f}, "
                f"{r['interval'][1]:.3f}]"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    spent = {s.name: timings(s.out) for s in (scratch, spec)}
    record = {
        "command": "python bench/upcycle_compare.py " + " ".join(sys.argv[1:]),
        "specs": [SCRATCH, DENSE], "code_commit": commit, "cpu": cpu_model(),
        "load_per_core": {"before": load_before, "after": load_per_core()},
        "this_invocation_wall_s": wall, "timings": spent,
        "upcycled_arm": {"dense_steps": args.dense_steps, "moe_steps": args.moe_steps,
                         "experts": EXPERTS, "top_k": TOP_K,
                         "data_seed_shift": DATA_SEED_SHIFT, "points": table},
        "theoretical": result["theoretical"], "realized": result["realized"],
        "compare": result,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{NAME}.json").write_text(json.dumps(record, indent=1) + "\n")
    report = markdown(result)
    (RESULTS / f"{NAME}.md").write_text(report.replace("(compare.png)", f"({NAME}.png)"))
    plot(result, RESULTS / f"{NAME}.png")
    print(report)
    print(f"wrote {RESULTS / NAME}.json, .md, .png")
    return 0


if __name__ == "__main__":
    run_main(main)
