"""Context extension study: the tiny preset pre-trained at 128 tokens, then extended to
1024 by a stage of its plan with each RoPE scaling, and what each extension bought and cost.

    PYTHONPATH=src python bench/long_context.py [--cells ...] [--report]

Recipe (configs/stages/long_context.yaml; the field's long-context stage scaled down):
- one run of 300 steps at seq_len 128, batch 16, WSD; its last 5% (steps 285..300) is the
  extension stage: seq_len 1024, batch 2 (tokens per step kept at 2048), the optimizer
  state and the whole-run LR decay continuing (0.33x -> 0.1x of peak: OLMo 3 extends in
  its final decay), the stage's RoPE and attention-logit multiplier from its first step.
- cells: the same plan with another extension stage, each a branch from the shared
  pre-training's kept checkpoint at step 285 (`moelab train --from RUN@285`): RoPE
  {no change, linear, ntk, llama3, yarn} x attn_logit_scale 1, yarn also at YaRN's logit
  factor at 8x ((0.1 ln 8 + 1)^2 = 1.459), yarn with half of each extension batch kept as
  short windows ("+short": stage short_fraction 0.5), and the baseline whose last 15 steps stay at
  128 tokens (not extended; equal tokens and LR). Its seed 0 is the pre-training run itself.
  A seed is data.seed: it changes the extension stage's batches only (the branch starts
  from the same weights and optimizer state).
- evaluation (`moelab.eval.longctx`): loss by 128-position bucket on held-out documents of
  >= 1025 tokens, the paired passkey (16 key pairs per depth, 5 depths, 1x/2x/4x/8x),
  short-context loss at 128 over the whole val split.
- is the passkey monotone in the extension's success? Spearman's rank correlation over the
  cells between their 0-1024 loss and (a) the key's log-prob at 8x, the issue's measure,
  (b) the paired gain at 8x, the part of it that comes from reading the key (an exact
  permutation p-value each).
- short-context regression both ways: against the checkpoint the extension started from
  (step 285; the issue's "before vs after extension") and against the baseline that
  trained the same 15 steps at 128 (equal tokens: the stricter yardstick).
- token dropping: the pre-trained router's (step 285) drop fraction under capacity dispatch
  (cf 1.25, one capacity group per sequence) and pooled dispatch (one pool per batch) on
  held-out windows of 128 (batch 16) vs 1024 (batch 2), same tokens per batch.

Writes bench/results/long_context/long_context.json (every cell) and long_context.{md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import yaml

from moelab.config import config_from_dict
from moelab.eval.bpb import val_windows as windows
from moelab.eval.longctx import evaluate, pooled_gain, short_context_loss
from moelab.model import Transformer
from moelab.train.checkpoint import load_latest
from moelab.train.interrupt import StopRequest
from moelab.train.rundir import RunDirLock
from moelab.train.trainer import Parent, Trainer, prepared_data

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "configs/stages/long_context.yaml"
RESULTS = ROOT / "bench/results/long_context"
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
# cell -> seeds: two for the baseline, the best cell of the earlier study (yarn) and the
# no-RoPE-change extension; one for the rest (the CPU budget: ~1 min of training and
# ~1 min of evaluation per run on 2 cores)
CELLS = {"baseline": (0, 1), "none/scale_1": (0, 1), "yarn/scale_1": (0, 1),
         "linear/scale_1": (0,), "ntk/scale_1": (0,), "llama3/scale_1": (0,),
         "yarn/scale_yarn": (0,), "yarn/scale_1+short": (0, 1)}
# "+short": half of each extension batch's sequences (1 of 2) cut into windows of 128 that
# attend only within themselves (stage short_fraction; ProLong keeps ~40% short data in its
# long-context training to hold short-context quality). Added after the study above found
# every extension's short-context loss 1.1-4.3% worse than not extending, "none" (no RoPE
# change) 1.6%: so the length mix of the batches, not the RoPE, costs most of it.
# Hypothesis, written before it ran: yarn+short regresses short-context loss by < 1% and
# still beats not extending at 8x by a clear margin (it trains half the long tokens).
SHORT_FRACTION = 0.5


def stage_of(cell: str, start: float) -> dict:
    """The extension stage of a cell (the baseline's stays at the pre-training length)."""
    if cell == "baseline":
        return {"name": "no-extension", "start": start}
    cell, short = cell.removesuffix("+short"), cell.endswith("+short")
    rope, scale = cell.split("/scale_")
    return {"name": f"extend-{rope}", "start": start, "seq_len": LONG,
            "model": {"rope": ROPES[rope], "attn_logit_scale": SCALES[scale]},
            **({"short_fraction": SHORT_FRACTION} if short else {})}


def cell_config(plan: dict, cell: str, seed: int):
    raw = json.loads(json.dumps(plan))
    raw["stages"][1] = stage_of(cell, raw["stages"][1]["start"])
    raw["data"]["seed"] = seed
    return config_from_dict(raw)


def train_cell(cfg, run_dir: Path, parent: Parent | None) -> float:
    """Train one run of the plan (a branch from `parent` if given); its wall seconds."""
    started = time.time()
    if not (run_dir / "checkpoints" / str(cfg.train.steps)).exists():
        with RunDirLock(run_dir), StopRequest() as stop:
            Trainer(cfg, run_dir, stop=stop, allow_config_change=True, parent=parent).run()
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
    gains = {m: pooled_gain(keys[m]) for m in keys}
    return {"loss_8x": float(np.mean([b["loss"] for b in buckets])),
            "loss_last": buckets[-1]["loss"], "short": run["short_context_loss"]["mean"],
            **{f"logprob_{m}": mean(keys[m], "key_logprob") for m in keys},
            **{f"gain_{m}": g for m, (g, _) in gains.items()},
            **{f"gain_se_{m}": se for m, (_, se) in gains.items()},
            "exact_8x": mean(keys["8x"], "exact")}


def rank_correlation(x: list[float], y: list[float]) -> dict[str, float]:
    """Spearman's rho of x and y and its exact two-sided permutation p-value (every
    ordering of y: 5040 for 7 cells)."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x), rankdata(y)
    rho = lambda b: float(np.corrcoef(rx, b)[0, 1])
    observed = rho(ry)
    perms = [rho(np.asarray(p)) for p in itertools.permutations(ry)]
    p = float(np.mean([abs(r) >= abs(observed) - 1e-12 for r in perms]))
    return {"spearman_rho": observed, "p_value": p, "cells": len(x)}


def _mean_sd(m: dict, sd: dict, k: str) -> str:
    return f"{m[k]:.3f}" + ("" if math.isnan(sd[k]) else f" +- {sd[k]:.3f}")


def report(results: dict, out: Path) -> str:
    """A markdown table (mean +- sd over seeds), the passkey/loss rank correlation (also
    stored in the JSON) and a plot of loss by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = cell_numbers(results["cells"]["baseline"]["seeds"]["0"])
    before = results["before_extension"]["short_context_loss"]["mean"]
    lines = ["| cell | seeds | loss 0-1024 | loss 896-1024 | short loss (128) | vs before "
             "extension | vs not extended | passkey logprob 8x | passkey gain 1x | passkey "
             "gain 8x (+- se) | exact 8x |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(7, 4))
    means = {}
    for name, cell in results["cells"].items():
        runs = [cell_numbers(r) for r in cell["seeds"].values()]
        if not runs:
            continue
        m = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        sd = {k: float(np.std([r[k] for r in runs], ddof=1)) if len(runs) > 1 else float("nan")
              for k in runs[0]}
        means[name] = m
        pm = functools.partial(_mean_sd, m, sd)
        # the gain's se over seeds: each seed's se, combined for their mean
        se = math.sqrt(sum(r["gain_se_8x"] ** 2 for r in runs)) / len(runs)
        lines.append(f"| {name} | {len(runs)} | {pm('loss_8x')} | {pm('loss_last')} | "
                     f"{pm('short')} | {100 * (m['short'] / before - 1):+.2f}% | "
                     f"{100 * (m['short'] / base['short'] - 1):+.2f}% | "
                     f"{pm('logprob_8x')} | {m['gain_1x']:+.2f} | {m['gain_8x']:+.2f} +- "
                     f"{se:.2f} | {m['exact_8x']:.2f} |")
        first = next(iter(cell["seeds"].values()))["loss_by_position"]["buckets"]
        curves = np.mean([[b["loss"] for b in r["loss_by_position"]["buckets"]]
                          for r in cell["seeds"].values()], axis=0)
        ax.plot([b["start"] for b in first], curves, marker=".", label=name,
                linestyle="--" if name == "baseline" else "-")
    names = list(means)
    loss = [means[n]["loss_8x"] for n in names]
    results["passkey_vs_loss"] = {
        "cells": names, **rank_correlation(loss, [means[n]["gain_8x"] for n in names])}
    results["passkey_logprob_vs_loss"] = {
        "cells": names, **rank_correlation(loss, [means[n]["logprob_8x"] for n in names])}
    out.write_text(json.dumps(results, indent=1) + "\n")
    lines.append(f"\nShort loss before extension (the pre-training at step "
                 f"{results['before_extension']['step']}): {before:.4f}")
    for key, what in (("passkey_logprob_vs_loss", "key log-prob 8x"),
                      ("passkey_vs_loss", "passkey gain 8x")):
        corr = results[key]
        lines.append(f"\nSpearman rho(loss 0-1024, {what}) over {corr['cells']} cells = "
                     f"{corr['spearman_rho']:+.2f} (exact permutation p = "
                     f"{corr['p_value']:.3f}; rising with the extension's success is -1)")
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
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--trials", type=int, default=16,
                        help="passkey pairs per length and depth")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/long_context_plan")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    parser.add_argument("--report", action="store_true",
                        help="only write the table and plot from --out")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(args.out.read_text()), args.out))
        return

    started = time.time()
    plan = yaml.safe_load(PLAN.read_text())
    pre_dir = args.work / "baseline_seed0"  # the pre-training: the plan, not extended
    base_cfg = cell_config(plan, "baseline", 0)
    boundary = base_cfg.plan.starts()[0]
    data_dir = prepared_data(base_cfg)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "plan" not in results.get("recipe", {}):  # another study's file: start afresh
        results = {}
    results.update({
        "recipe": {"plan": str(PLAN.relative_to(ROOT)), "steps": base_cfg.train.steps,
                   "extension_start": boundary, "pretrain_seq_len": ORIGINAL,
                   "pretrain_batch": base_cfg.data.batch_size, "extension_seq_len": LONG,
                   "extension_batch": cell_config(plan, "yarn/scale_1", 0).plan.stages[
                       1].batch_size, "yarn_logit_scale": YARN_LOGIT,
                   "passkey_trials": args.trials},
    })
    cells = results.setdefault("cells", {})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trained = False
    for name in args.cells:
        rope = "none (not extended)" if name == "baseline" else ROPES[name.split("/")[0]]
        cell = cells.setdefault(name, {"stage": stage_of(name, plan["stages"][1]["start"]),
                                       "rope": rope, "seeds": {}})
        for seed in CELLS[name]:
            if str(seed) in cell["seeds"]:
                continue
            first = name == "baseline" and seed == 0
            run_dir = pre_dir if first else args.work / f"{name.replace('/', '_')}_seed{seed}"
            if not first and not pre_dir.exists():
                raise SystemExit(f"{name}: the pre-training run {pre_dir} is gone; remove the "
                                 f"baseline's seed 0 from {args.out} to train it again")
            trained = True
            train_s = train_cell(cell_config(plan, name, seed), run_dir,
                                 None if first else Parent(pre_dir, boundary))
            model, cfg, _ = load_latest(run_dir)
            # the checkpoint loads with the extension stage's RoPE (what export would write)
            assert cfg.model == cell_config(plan, name, seed).plan.stages[-1].model
            t = time.time()
            cell["seeds"][str(seed)] = {**evaluate(model, data_dir, ORIGINAL,
                                                   trials=args.trials),
                                        "train_s": train_s, "eval_s": time.time() - t}
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            numbers = cell_numbers(cell["seeds"][str(seed)])
            print(f"{name} seed {seed}: loss 0-1024 {numbers['loss_8x']:.4f}, passkey gain "
                  f"8x {numbers['gain_8x']:+.2f} +- {numbers['gain_se_8x']:.2f} (train "
                  f"{train_s:.0f}s, eval {time.time() - t:.0f}s, total "
                  f"{time.time() - started:.0f}s)", flush=True)
    if "drops" not in results or "before_extension" not in results:
        pre_model, _, _ = load_latest(pre_dir, only_step=boundary)
        results["drops"] = drop_fractions(pre_model, data_dir, ORIGINAL * base_cfg.data
                                          .batch_size)
        print("drops", json.dumps(results["drops"]), flush=True)
        # the short-context regression is before vs after the extension: the
        # shared pre-training's checkpoint at the stage boundary, the same for every cell
        results["before_extension"] = {
            "step": boundary, "short_context_loss": short_context_loss(pre_model, data_dir,
                                                                       ORIGINAL)}
    if trained:  # a call that only evaluates or reports keeps the study's wall time
        results["wall_s"] = time.time() - started
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(report(results, args.out))


if __name__ == "__main__":
    sys.exit(main())
