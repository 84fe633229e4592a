"""Aux-loss vs. bias balancing on the tiny preset: expert load and val loss at the end.

    python3 bench/balance.py [--runs runs/bench/balance] [--steps 300] [--seed 0]
                             [--methods NAME ...]

Trains the tiny preset once per entry of METHODS (a run directory that already holds a
finished run is reused): `aux_loss` (the preset as it ships: softmax router, aux weight
0.01); the sign rule (`bias_sign`) and Marin's quantile rule (`bias_quantile`) with a
sigmoid router and no aux loss, at several rates, with the rate constant or falling with
the LR (`moe.bias_rate_schedule: lr_decay`); and the same plus DeepSeek-V3's sequence-wise
aux loss (`loss.seq_aux_weight`). `--methods` runs a subset and keeps the other entries of
the JSON; `--seed s` sets train.seed and data.seed and names the entries `NAME@seed<s>`
(the val loss is compared with `aux_loss` of the same seed).

Then, on 100 training batches the runs never saw (indices past the last step), the final
model's expert loads per layer: max/mean per batch (what a capacity dispatch feels, and
what the per-step logs show) with its standard error, and of the batches summed (what one
fixed bias can fix). The floors say where the rest comes from: the same router under the
best fixed bias (balancing all held-out batches together), under a bias solved for each
batch alone (an oracle), and with batches re-drawn from the held-out sequences at random
or with each source in its mean proportion; plus iid tokens at perfect balance (sampling
alone). Layer 1's floors hold layer 0's routing as trained. Writes
bench/results/balance_tiny/balance_tiny.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from machine import run_main  # bench/machine.py

from moelab.config import load_config
from moelab.data.loader import Loader
from moelab.model.layers import rope_angles
from moelab.model.moe import MoE
from moelab.train.checkpoint import load_latest
from moelab.train.cli import config_path
from moelab.train.trainer import train

RESULTS = Path(__file__).parent / "results" / "balance_tiny" / "balance_tiny.json"
BIAS = {"moe.router": "sigmoid", "loss.aux_weight": 0.0}
SIGN = {**BIAS, "moe.balance": "bias_sign", "moe.bias_rate": 0.01}
QB = {**BIAS, "moe.balance": "bias_quantile"}
SEQ_AUX = {"loss.seq_aux_weight": 0.01}
LR_DECAY = {"moe.bias_rate_schedule": "lr_decay"}
METHODS = {
    "aux_loss": {},
    "bias_sign": SIGN,
    "bias_quantile": QB,
    "bias_quantile_hard": {**QB, "moe.quantile_rate": 1.0},
    # the sign rule plus DeepSeek-V3's sequence-wise loss against per-sequence concentration
    "bias_sign_seq_aux": {**SIGN, **SEQ_AUX},
    "bias_sign_seq_aux_0.03": {**SIGN, "loss.seq_aux_weight": 0.03},
    "bias_sign_seq_aux_0.1": {**SIGN, "loss.seq_aux_weight": 0.1},
    # the rate follows the LR down in the decay, so the final bias is not one batch's echo
    "bias_sign_lr_decay": {**SIGN, **LR_DECAY},
    "bias_sign_seq_aux_lr_decay": {**SIGN, **SEQ_AUX, **LR_DECAY},
    "bias_sign_seq_aux_0.03_lr_decay": {**SIGN, "loss.seq_aux_weight": 0.03, **LR_DECAY},
    "bias_sign_seq_aux_0.05_lr_decay": {**SIGN, "loss.seq_aux_weight": 0.05, **LR_DECAY},
    "bias_sign_seq_aux_0.1_lr_decay": {**SIGN, "loss.seq_aux_weight": 0.1, **LR_DECAY},
    # +0.01 of bias moves ~10-15% of an expert's load here: a finer or a coarser sign step
    "bias_sign_0.02_seq_aux_0.05_lr_decay": {**SIGN, "moe.bias_rate": 0.02,
                                             "loss.seq_aux_weight": 0.05, **LR_DECAY},
    "bias_sign_0.003_seq_aux_0.03_lr_decay": {**SIGN, "moe.bias_rate": 0.003,
                                              "loss.seq_aux_weight": 0.03, **LR_DECAY},
    # QB's rate falling with the LR: at the end an average of the last ~1/(0.1 rate) batches'
    # balancing biases instead of one batch's
    "bias_quantile_0.3_lr_decay": {**QB, "moe.quantile_rate": 0.3, **LR_DECAY},
    "bias_quantile_hard_lr_decay": {**QB, "moe.quantile_rate": 1.0, **LR_DECAY},
    "bias_quantile_0.3_seq_aux_lr_decay": {**QB, "moe.quantile_rate": 0.3, **SEQ_AUX,
                                           **LR_DECAY},
}
HELD_OUT = 100


def finished(run: Path, steps: int) -> bool:
    log = run / "metrics.jsonl"
    return log.exists() and json.loads(log.read_text().splitlines()[-1])["step"] == steps


@eqx.filter_jit
def loads(model, batch):
    return model(batch[:, :-1])[1].tokens_per_expert  # [L_moe, E]


@eqx.filter_jit
def router_scores(model, batch) -> jnp.ndarray:
    """[L_moe, B*S, E]: each MoE layer's unbiased routing scores (what the bias is added to)."""
    tokens = batch[:, :-1]
    b, s = tokens.shape
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(s), (b, s)),
                           model.cfg.resolved_head_dim, model.cfg.rope_theta)
    x, out = model.embed[tokens], []
    for block in model.blocks:
        if isinstance(block.ffn, MoE):
            h = x + block.attn(block.attn_norm(x), cos, sin)[0]
            logits = (block.ffn_norm(h) @ block.ffn.router).reshape(b * s, -1)
            out.append(jax.nn.softmax(logits, -1) if block.ffn.moe.router == "softmax"
                       else jax.nn.sigmoid(logits))
        x = block(x, cos, sin)[0]
    return jnp.stack(out)


def choice_loads(choice, k: int) -> np.ndarray:
    """[..., T, E] biased scores -> [..., E] assignments per expert of a top-k choice."""
    top = jax.lax.top_k(jnp.asarray(choice), k)[1]
    return np.asarray(jax.nn.one_hot(top, choice.shape[-1]).sum((-3, -2)))


def share_margin(choice: np.ndarray, k: int) -> np.ndarray:
    """router.share_margin in numpy: np.partition is linear in T, while XLA's CPU top_k
    with k = T*K/E sorts (200 rounds on 100 batches took 90 s a layer, here ~2 s)."""
    t, e = choice.shape
    top = np.sort(np.partition(choice, e - k - 1, axis=-1)[:, e - k - 1:], -1)  # k+1 best
    kth, next_ = top[:, 1:2], top[:, :1]
    margin = choice - np.where(choice >= kth, next_, kth)
    share = math.ceil(t * k / e)
    return np.partition(margin, t - share, axis=0)[t - share]


def balancing_bias(scores: np.ndarray, k: int, rounds: int = 200) -> np.ndarray:
    """A bias [E] giving every expert its share of the tokens `scores` [T, E]: the quantile
    rule iterated on the same tokens, half a step at a time (a full step overshoots: every
    expert moves by its own margin at once)."""
    bias = np.zeros(scores.shape[-1])
    for _ in range(rounds):
        target = bias - share_margin(scores + bias, k)
        bias += 0.5 * (target - target.mean() - bias)
    return bias


def ratio(a: np.ndarray) -> np.ndarray:
    return a.max(-1) / a.mean(-1)


def sampling_floor(tokens: int, k: int, n_experts: int, batches: int = 4000) -> float:
    """Mean max/mean load of batches of `tokens` iid tokens, each picking k distinct experts
    uniformly at random: what perfect balance in expectation still shows per batch."""
    rng = np.random.default_rng(0)
    counts = np.stack([
        np.bincount(np.argsort(rng.random((tokens, n_experts)), -1)[:, :k].ravel(),
                    minlength=n_experts) for _ in range(batches)])
    return float(ratio(counts).mean())


def floors(model, cfg, held: np.ndarray, sources: np.ndarray) -> dict:
    """Per layer, on the held-out batches' routing scores `held` [N, L, T, E]: max/mean per
    batch under the best fixed bias (the one balancing the N batches together), under a
    bias solved for each batch alone (an oracle no fixed bias reaches), and for batches
    re-drawn from the held-out sequences (fixed bias) at random or with the sources in
    their mean proportion (`sources` [N, B]: the batch's source mix is one part of the
    sequence-mix spread)."""
    k, (n, layers, t, e), b = cfg.moe.top_k, held.shape, cfg.data.batch_size
    rng = np.random.default_rng(0)
    src = sources.reshape(-1)
    share = np.bincount(src) / src.size
    per_source = np.round(share * b).astype(int)
    per_source[np.argmax(per_source)] += b - per_source.sum()
    out = {k_: [] for k_ in ("fixed_bias_per_batch", "fixed_bias_summed",
                             "oracle_bias_per_batch", "redrawn_random_mix_per_batch",
                             "redrawn_source_stratified_per_batch")}
    for layer in range(layers):
        scores = held[:, layer]
        fixed = balancing_bias(scores.reshape(-1, e), k)
        fixed_loads = choice_loads(scores + fixed, k)
        oracle = np.stack([choice_loads(s + balancing_bias(s, k), k)
                           for s in scores])
        seqs = choice_loads((scores + fixed).reshape(n * b, t // b, e), k)
        random_mix = [seqs[rng.choice(n * b, b)].sum(0) for _ in range(2000)]
        stratified = [seqs[np.concatenate([rng.choice(np.flatnonzero(src == i), c)
                                           for i, c in enumerate(per_source) if c])].sum(0)
                      for _ in range(2000)]
        for name, value in (
                ("fixed_bias_per_batch", ratio(fixed_loads).mean()),
                ("fixed_bias_summed", ratio(fixed_loads.sum(0))),
                ("oracle_bias_per_batch", ratio(oracle).mean()),
                ("redrawn_random_mix_per_batch", ratio(np.stack(random_mix)).mean()),
                ("redrawn_source_stratified_per_batch", ratio(np.stack(stratified)).mean())):
            out[name].append(round(float(value), 4))
    return out


def measure(run: Path, steps: int) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    model, cfg, _ = load_latest(run)
    d = cfg.data
    loader = Loader(Path(d.path), "train", d.seq_len, d.batch_size, d.mixture, d.seed)
    batches = [jnp.asarray(loader.batch(steps + i)) for i in range(HELD_OUT)]
    held = np.stack([np.asarray(loads(model, batch)) for batch in batches])
    layers = held.shape[1]
    scores = np.stack([np.asarray(router_scores(model, batch)) for batch in batches])
    sources = np.stack([loader.plan(steps + i)[0] for i in range(HELD_OUT)])
    val = {k: v for k, v in rows[-1].items() if k.startswith("val_loss/")}
    return {
        "val_loss": val, "val_loss_mean": float(np.mean(list(val.values()))),
        "last_step_max_over_mean": [rows[-1][f"expert_load_max_over_mean/layer_{i}"]
                                    for i in range(layers)],
        "last20_steps_max_over_mean": [float(np.mean(
            [r[f"expert_load_max_over_mean/layer_{i}"] for r in rows[-20:]]))
            for i in range(layers)],
        "held_out_per_batch_max_over_mean": ratio(held).mean(0).round(4).tolist(),
        "held_out_per_batch_std_error": (ratio(held).std(0, ddof=1) / np.sqrt(HELD_OUT)
                                         ).round(4).tolist(),
        "held_out_summed_max_over_mean": ratio(held.sum(0)).round(4).tolist(),
        "bias_range": [rows[-1].get(f"bias_range/layer_{i}") for i in range(layers)],
        "floor": floors(model, cfg, scores, sources),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="runs/bench/balance")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="train/measure only these; the others keep their JSON entries")
    parser.add_argument("--seed", type=int, default=0,
                        help="train.seed and data.seed; entries of seed s > 0 are 'name@seed<s>'")
    args = parser.parse_args()
    suffix = f"@seed{args.seed}" if args.seed else ""
    out = json.loads(RESULTS.read_text())["methods"] if RESULTS.exists() else {}
    for name in args.methods:
        overrides = {**METHODS[name], "train.seed": args.seed, "data.seed": args.seed}
        run = Path(args.runs) / (name + suffix)
        if not finished(run, args.steps):
            cfg = load_config(config_path("tiny"), {**overrides, "train.steps": args.steps})
            train(cfg, run)
        out[name + suffix] = {"overrides": overrides, **measure(run, args.steps)}
        print(name + suffix, json.dumps(out[name + suffix]))
    for key, entry in out.items():  # val loss vs the aux-loss run of the same seed
        base = out.get("aux_loss" + key[len(key.split("@")[0]):])
        entry["val_loss_vs_aux_pct"] = (
            round(100 * (entry["val_loss_mean"] / base["val_loss_mean"] - 1), 3) if base else None)
    cfg = load_config(config_path("tiny"), {})
    floor = sampling_floor(cfg.data.batch_size * cfg.data.seq_len, cfg.moe.top_k,
                           cfg.moe.n_experts)
    RESULTS.write_text(json.dumps({"preset": "tiny", "steps": args.steps,
                                   "iid_sampling_floor_per_batch": round(floor, 4),
                                   "methods": out}, indent=2) + "\n")
    print(f"iid sampling floor per batch {floor:.4f}; wrote {RESULTS}")


if __name__ == "__main__":
    run_main(main)
