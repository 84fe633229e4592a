"""Context extension study: pre-train the tiny preset at 128 tokens once, then extend it to
1024 tokens with each RoPE scaling, and measure what each extension bought and cost.

    PYTHONPATH=src python bench/long_context.py [--seeds 0 1] [--cells ...] [--quick]

Recipe (the field's: OLMo 3's and Marin Snowball's long-context stages, scaled down):
- pre-train: the tiny preset as shipped (seq_len 128, batch 16, 300 steps, WSD to 0.1x).
- extension (one run per cell and seed): restore the pre-trained *weights only*
  (`train.checkpoint.restore_weights`, what a later `moelab train --from RUN --weights-only`
  can reuse) into a run at seq_len 1024 with batch 2 (tokens per step kept at 2048), for
  5% of the pre-training tokens (15 steps), fresh AdamW, peak LR 10% of pre-training's
  (its final LR) decaying linearly to 1% (Marin: 5% -> 1% of peak), and the cell's RoPE
  change and attention-logit multiplier. The seed changes the extension's data order only.
- cells: RoPE {no change, linear, ntk, llama3, yarn} x attn_logit_scale {1, YaRN's logit
  factor at 8x, (0.1 ln 8 + 1)^2 = 1.459}, plus the pre-trained model without extension.
- evaluation (`moelab.eval.longctx`): loss by 128-position bucket on held-out documents of
  >= 1025 tokens, passkey at 1x/2x/4x/8x and 5 depths, short-context loss at 128.
- token dropping: the pre-trained router's drop fraction under capacity dispatch (cf 1.25,
  one capacity group per sequence) and pooled dispatch (one pool per batch) on held-out
  windows of 128 (batch 16) vs 1024 (batch 2), same tokens per batch.

Writes bench/results/long_context.json (every cell) and long_context.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from moelab.config import config_from_dict, config_to_dict, load_config
from moelab.eval.longctx import evaluate
from moelab.ladder.evaluate import windows
from moelab.model import Transformer
from moelab.train.checkpoint import load_latest, restore_weights
from moelab.train.interrupt import StopRequest
from moelab.train.rundir import RunDirLock
from moelab.train.trainer import Trainer, prepared_data, train

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "src/moelab/presets/tiny.yaml"
RESULTS = ROOT / "bench/results"
ORIGINAL, LONG = 128, 1024
FACTOR = LONG / ORIGINAL
YARN_LOGIT = (0.1 * math.log(FACTOR) + 1) ** 2  # YaRN's temperature, as a logit multiplier
ROPES = {
    "none": {"type": "default"},
    "linear": {"type": "linear", "factor": FACTOR},
    "ntk": {"type": "ntk", "factor": FACTOR},
    "llama3": {"type": "llama3", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL},
}
SCALES = {"1": 1.0, "yarn": YARN_LOGIT}


def pretrain(run_dir: Path, steps: int) -> dict:
    cfg = load_config(PRESET, {"train.steps": steps, "train.checkpoint_every": steps,
                               "train.eval_every": steps})
    if not (run_dir / "checkpoints" / str(steps)).exists():
        train(cfg, run_dir)
    return config_to_dict(cfg)


def extension_config(base: dict, rope: dict, scale: float, seed: int, steps: int):
    raw = json.loads(json.dumps(base))
    raw["model"].update(rope=rope, attn_logit_scale=scale)
    raw["data"].update(seq_len=LONG, batch_size=base["data"]["batch_size"] * ORIGINAL // LONG,
                       seed=seed)
    peak = base["optim"]["lr"] * 0.1
    raw["optim"].update(lr=peak, warmup_steps=1, schedule="wsd", decay_fraction=1.0,
                        min_lr_ratio=0.1)
    raw["train"].update(steps=steps, seed=seed, eval_every=steps, checkpoint_every=steps,
                        log_every=max(1, steps // 3))
    return config_from_dict(raw)


def extend(pre_dir: Path, run_dir: Path, cfg) -> float:
    """Train one extension run from the pre-trained weights; returns its wall seconds."""
    started = time.time()
    if not (run_dir / "checkpoints" / str(cfg.train.steps)).exists():
        with RunDirLock(run_dir), StopRequest() as stop:
            trainer = Trainer(cfg, run_dir, stop=stop)
            if trainer.step == 0:
                trainer.model = restore_weights(pre_dir, trainer.model, cfg)
            trainer.run()
    return time.time() - started


def with_dispatch(model: Transformer, **moe) -> Transformer:
    """The same weights under another moe dispatch (the router is unchanged)."""
    blocks = [b.ffn.moe for b in model.blocks if hasattr(b.ffn, "moe")]
    new = dataclasses.replace(blocks[0], **moe)
    skeleton = eqx.filter_eval_shape(Transformer.init, model.cfg, new, jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


def drop_fractions(model: Transformer, data_dir: Path, tokens_per_batch: int) -> dict:
    """Mean drop fraction (over layers and batches) of held-out windows at 128 and 1024."""
    out = {}
    forward = eqx.filter_jit(lambda m, x: m(x)[1].drop_frac)
    for dispatch in ("capacity", "pooled"):
        routed = with_dispatch(model, dispatch=dispatch, capacity_factor=1.25, pool_size=0)
        for length in (ORIGINAL, LONG):
            rows = np.concatenate([windows(data_dir, s, length) for s in ("code", "prose")])
            batch = tokens_per_batch // length
            n = len(rows) // batch * batch
            drops = [np.asarray(forward(routed, rows[i:i + batch, :-1]))
                     for i in range(0, n, batch)]
            out[f"{dispatch}/{length}"] = {"drop_frac": float(np.mean(drops)),
                                          "batches": n // batch, "sequences_per_batch": batch}
    return out


def cell_numbers(run: dict) -> dict[str, float]:
    """The numbers one evaluated model contributes to the table."""
    buckets = run["loss_by_position"]["buckets"]
    keys = run["passkey"]
    mean = lambda rows, k: float(np.mean([r[k] for r in rows]))
    return {"loss_8x": float(np.mean([b["loss"] for b in buckets])),
            "loss_last": buckets[-1]["loss"], "short": run["short_context_loss"]["mean"],
            **{f"logprob_{m}": mean(keys[m], "key_logprob") for m in keys},
            **{f"gain_{m}": mean(keys[m], "retrieval_gain") for m in keys},
            "exact_8x": mean(keys["8x"], "exact")}


def _mean_sd(m: dict, sd: dict, k: str) -> str:
    return f"{m[k]:.3f}" + ("" if math.isnan(sd[k]) else f" +- {sd[k]:.3f}")


def report(results: dict, out: Path) -> str:
    """A markdown table (mean +- sd over seeds) and a plot of loss by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = cell_numbers(results["cells"]["baseline"]["seeds"]["-"])
    lines = ["| cell | seeds | loss 0-1024 | loss 896-1024 | short loss (128) | vs not "
             "extended | passkey logprob 8x | retrieval gain 1x / 8x | exact 8x |",
             "|---|---|---|---|---|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, cell in results["cells"].items():
        runs = [cell_numbers(r) for r in cell["seeds"].values()]
        if not runs:
            continue
        m = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        sd = {k: float(np.std([r[k] for r in runs], ddof=1)) if len(runs) > 1 else float("nan")
              for k in runs[0]}
        pm = functools.partial(_mean_sd, m, sd)
        lines.append(f"| {name} | {len(runs)} | {pm('loss_8x')} | {pm('loss_last')} | "
                     f"{pm('short')} | {100 * (m['short'] / base['short'] - 1):+.2f}% | "
                     f"{pm('logprob_8x')} | {m['gain_1x']:+.2f} / {m['gain_8x']:+.2f} | "
                     f"{m['exact_8x']:.2f} |")
        first = next(iter(cell["seeds"].values()))["loss_by_position"]["buckets"]
        curves = np.mean([[b["loss"] for b in r["loss_by_position"]["buckets"]]
                          for r in cell["seeds"].values()], axis=0)
        ax.plot([b["start"] for b in first], curves, marker=".", label=name,
                linestyle="--" if name == "baseline" else "-")
    ax.set(xlabel="position bucket start (tokens)", ylabel="held-out CE",
           title="loss by position after extension 128 -> 1024")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    table = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--ropes", nargs="+", default=list(ROPES), choices=list(ROPES))
    parser.add_argument("--scales", nargs="+", default=list(SCALES), choices=list(SCALES))
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=4, help="passkeys per length and depth")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/long_context")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    parser.add_argument("--report", action="store_true",
                        help="only write the table and plot from --out")
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="result files of runs split over processes: their cells' seeds "
                        "are merged into --out, then the report is written")
    args = parser.parse_args()
    if args.merge:
        merged = json.loads(args.merge[0].read_text())
        for path in args.merge[1:]:
            for name, cell in json.loads(path.read_text())["cells"].items():
                merged["cells"].setdefault(name, {**cell, "seeds": {}})["seeds"].update(
                    cell["seeds"])
        merged["seeds"] = sorted({int(s) for c in merged["cells"].values()
                                  for s in c["seeds"] if s != "-"})
        merged.pop("wall_s", None)
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    if args.report or args.merge:
        print(report(json.loads(args.out.read_text()), args.out))
        return

    started = time.time()
    pre_dir = args.work / "pretrain"
    base = pretrain(pre_dir, args.pretrain_steps)
    data_dir = prepared_data(config_from_dict(base))
    ext_steps = max(1, round(0.05 * args.pretrain_steps))
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update({
        "recipe": {"pretrain_steps": args.pretrain_steps, "pretrain_seq_len": ORIGINAL,
                   "pretrain_batch": base["data"]["batch_size"], "extension_steps": ext_steps,
                   "extension_seq_len": LONG,
                   "extension_batch": base["data"]["batch_size"] * ORIGINAL // LONG,
                   "extension_lr": [base["optim"]["lr"] * 0.1, base["optim"]["lr"] * 0.01],
                   "yarn_logit_scale": YARN_LOGIT, "passkey_trials": args.trials},
        "seeds": args.seeds,
    })
    cells = results.setdefault("cells", {})
    pre_model, _, _ = load_latest(pre_dir)
    if "baseline" not in cells:
        t = time.time()
        cells["baseline"] = {"rope": "none (not extended)", "attn_logit_scale": 1.0,
                             "seeds": {"-": evaluate(pre_model, data_dir, ORIGINAL,
                                                     trials=args.trials)},
                             "eval_s": time.time() - t}
        print(f"baseline evaluated in {time.time() - t:.0f}s", flush=True)
    if "drops" not in results:
        results["drops"] = drop_fractions(pre_model, data_dir, ORIGINAL * base["data"][
            "batch_size"])
        print("drops", json.dumps(results["drops"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for rope in args.ropes:
        for scale in args.scales:
            name = f"{rope}/scale_{scale}"
            cell = cells.setdefault(name, {"rope": ROPES[rope], "attn_logit_scale":
                                           SCALES[scale], "seeds": {}})
            for seed in args.seeds:
                if str(seed) in cell["seeds"]:
                    continue
                cfg = extension_config(base, ROPES[rope], SCALES[scale], seed, ext_steps)
                run_dir = args.work / f"{rope}_scale_{scale}_seed{seed}"
                train_s = extend(pre_dir, run_dir, cfg)
                model, _, _ = load_latest(run_dir)
                t = time.time()
                cell["seeds"][str(seed)] = {**evaluate(model, data_dir, ORIGINAL,
                                                       trials=args.trials),
                                            "train_s": train_s, "eval_s": time.time() - t}
                args.out.write_text(json.dumps(results, indent=1) + "\n")
                last = cell["seeds"][str(seed)]["loss_by_position"]["buckets"][-1]["loss"]
                print(f"{name} seed {seed}: last-bucket loss {last:.4f} "
                      f"(train {train_s:.0f}s, eval {time.time() - t:.0f}s, total "
                      f"{time.time() - started:.0f}s)", flush=True)
    results["wall_s"] = time.time() - started
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(report(results, args.out))


if __name__ == "__main__":
    sys.exit(main())
