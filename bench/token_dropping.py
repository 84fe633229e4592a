"""How many token-assignments capacity-limited dispatch drops, as context grows.

    python3 bench/token_dropping.py [--steps 300] [--batches 8]

1. Train a small MoE (8 experts, top-2, dropless, aux loss on) for a few hundred steps on
   the default corpus, so the router is a trained one, not random weights. The run is
   kept in runs/bench/token_dropping and reused when already complete.
2. For each context length L in 512, 2K, 8K, 32K, draw batches of 32K tokens
   (64 x 512, 16 x 2K, 4 x 8K, 1 x 32K) and record every MoE layer's routing.
3. Count the assignments each dispatch would drop, with the dispatch code itself
   (`grouped_dispatch` on the recorded routing): capacity per sequence at capacity
   factor 1.0 and 1.25, pooled over the whole batch at 1.0 and 1.25, and dropless.

Routing at long context: the model was trained on windows of `seq_len` tokens, and its
attention has never seen 32K positions. So a row of L tokens (contiguous text from one
source's stream) is routed window by window (each window of seq_len tokens attends
within itself), then the decisions are grouped back into the row. What varies with L is
exactly what the drop counts depend on: how many tokens share a capacity group and how
many independent stretches of text a batch of fixed size holds.

Prints a table; writes bench/results/token_dropping.json and token_dropping.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import MoEConfig, config_from_dict
from moelab.data.loader import Loader
from moelab.model.dispatch import Experts
from moelab.model.dispatch.capacity import grouped_dispatch
from moelab.model.dispatch.dropless import dropless_dispatch
from moelab.model.layers import rope_angles
from moelab.model.moe import MoE
from moelab.model.router import Routing, route
from moelab.train.checkpoint import Checkpointer, load_latest
from moelab.train.trainer import train

RESULTS = Path(__file__).parent / "results"
RUN_DIR = Path("runs/bench/token_dropping")
CONTEXTS = (512, 2048, 8192, 32768)
MODES = {  # column -> (dispatch, capacity_factor)
    "capacity cf1.0": ("capacity", 1.0),
    "capacity cf1.25": ("capacity", 1.25),
    "pooled cf1.0": ("pooled", 1.0),
    "pooled cf1.25": ("pooled", 1.25),
    "dropless": ("dropless", 1.0),
}


def router_config(steps: int) -> dict:
    """The tiny preset's model at seq_len 256: trains in a few minutes on 2 CPU cores."""
    return {
        "model": {"vocab_size": 4096, "d_model": 128, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "d_ff": 128},
        "moe": {"n_experts": 8, "top_k": 2, "dispatch": "dropless"},
        "data": {"path": "runs/data/default", "seq_len": 256, "batch_size": 16},
        "optim": {"lr": 3e-3, "warmup_steps": 20},
        "train": {"steps": steps, "log_every": 50, "eval_every": steps,
                  "checkpoint_every": steps, "eval_batches": 4},
    }


def trained_model(steps: int):
    cfg = config_from_dict(router_config(steps))
    if Checkpointer(RUN_DIR, 1).latest_step() != steps:
        train(cfg, RUN_DIR)
    model, cfg, _ = load_latest(RUN_DIR)
    return model, cfg


@eqx.filter_jit
def routed_experts(model, tokens: jax.Array) -> jax.Array:
    """Chosen experts [L_moe, N, W, K] of every MoE layer for windows tokens [N, W]."""
    n, w = tokens.shape
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(w), (n, w)),
                           model.cfg.resolved_head_dim, model.cfg.rope_theta)
    x, chosen = model.embed[tokens], []
    for block in model.blocks:  # Block.__call__, keeping each router's decisions
        h = x + block.attn(block.attn_norm(x), cos, sin)[0]
        u = block.ffn_norm(h)
        if isinstance(block.ffn, MoE):
            logits = jnp.einsum("bsd,de->bse", u, block.ffn.router)
            chosen.append(route(logits, block.ffn.moe, block.ffn.bias)[0].experts)
            x = h + block.ffn(u)[0]
        else:
            x = h + block.ffn(u)
    return jnp.stack(chosen)


@partial(jax.jit, static_argnums=(1, 2, 3))
def dropped_count(experts: jax.Array, n_experts: int, dispatch: str, capacity_factor: float):
    """Assignments of routing [B, L, K] that `dispatch` drops, counted by the dispatch code."""
    b, length, k = experts.shape
    moe = MoEConfig(n_experts=n_experts, top_k=k, dispatch=dispatch,
                    capacity_factor=capacity_factor)
    ones = jnp.ones(experts.shape, jnp.float32)
    if dispatch == "dropless":
        tiny = Experts(moe.n_experts, 1, 1, 0.0, jax.random.key(0))
        _, dropped = dropless_dispatch(jnp.zeros((b, length, 1)), Routing(experts, ones), tiny,
                                       moe)
    else:
        groups = b if dispatch == "capacity" else 1  # pooled: the whole batch is one pool
        grouped = Routing(experts.reshape(groups, -1, k), ones.reshape(groups, -1, k))
        _, dropped = grouped_dispatch(jnp.zeros((groups, b * length // groups, 1)), grouped,
                                      lambda slots: slots, moe)
    return dropped.total


def measure(model, cfg, batches: int, tokens_per_batch: int) -> dict:
    window = cfg.data.seq_len
    out = {}
    for length in CONTEXTS:
        rows = tokens_per_batch // length
        loader = Loader(cfg.data.path, "train", length, rows, {}, seed=12345)
        per_batch = {mode: [] for mode in MODES}
        for step in range(batches):
            tokens = loader.batch(step)[:, :length].reshape(-1, window)
            layers = np.asarray(routed_experts(model, jnp.asarray(tokens)))
            for mode, (dispatch, cf) in MODES.items():
                per_layer = [int(dropped_count(e.reshape(rows, length, -1), cfg.moe.n_experts,
                                               dispatch, cf)) / e.size for e in layers]
                per_batch[mode].append(per_layer)
        out[str(length)] = {
            "sequences_per_batch": rows,
            "drop_frac": {m: float(np.mean(v)) for m, v in per_batch.items()},
            "drop_frac_per_layer": {m: np.mean(v, axis=0).round(5).tolist()
                                    for m, v in per_batch.items()},
            "drop_frac_std_over_batches": {m: float(np.std(np.mean(v, axis=1)))
                                           for m, v in per_batch.items()},
        }
    return out


def plot(table: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in MODES:
        ax.plot(CONTEXTS, [100 * table[str(c)]["drop_frac"][mode] for c in CONTEXTS],
                marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xticks(CONTEXTS, [f"{c // 1024}K" if c >= 1024 else str(c) for c in CONTEXTS])
    ax.set_xlabel("context length (tokens per batch fixed)")
    ax.set_ylabel("dropped token-assignments (%)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=-1, top=1.3 * ax.get_ylim()[1])  # room for the legend above the lines
    ax.grid(alpha=0.3)
    ax.legend(ncol=3, loc="upper center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="router training steps")
    parser.add_argument("--batches", type=int, default=8, help="batches per context length")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per batch")
    args = parser.parse_args()
    started = time.time()
    model, cfg = trained_model(args.steps)
    trained_s = time.time() - started
    table = measure(model, cfg, args.batches, args.tokens)
    metrics = [json.loads(line) for line in (RUN_DIR / "metrics.jsonl").read_text().splitlines()]
    result = {
        "question": "dropped fraction of token-assignments vs context length, fixed tokens/batch",
        "router": {"run_dir": str(RUN_DIR), "steps": args.steps,
                   "final_train_loss": metrics[-1]["loss"],
                   "final_expert_load_max_over_mean": {
                       k.split("/")[-1]: round(v, 3) for k, v in metrics[-1].items()
                       if k.startswith("expert_load_max_over_mean/")},
                   "model": router_config(args.steps)["model"],
                   "moe": router_config(args.steps)["moe"],
                   "routing_window": cfg.data.seq_len},
        "tokens_per_batch": args.tokens, "batches_per_context": args.batches,
        "modes": {m: {"dispatch": d, "capacity_factor": cf} for m, (d, cf) in MODES.items()},
        "pooled_group": "the whole batch (pool_size 0, one device)",
        "contexts": table,
        "seconds": {"train_or_load": round(trained_s, 1),
                    "measure": round(time.time() - started - trained_s, 1)},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "token_dropping.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(table, RESULTS / "token_dropping.png",
         f"MoE 8 experts top-2, router trained {args.steps} steps; {args.tokens} tokens/batch")
    print(f"{'context':>8} {'seqs':>5} " + " ".join(f"{m:>16}" for m in MODES))
    for length in CONTEXTS:
        row = table[str(length)]
        print(f"{length:>8} {row['sequences_per_batch']:>5} "
              + " ".join(f"{100 * row['drop_frac'][m]:>15.2f}%" for m in MODES))


if __name__ == "__main__":
    main()
