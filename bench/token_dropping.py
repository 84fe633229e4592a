"""Token dropping vs context length on 8 (fake CPU) expert-parallel devices, v2.

    python3 bench/token_dropping.py [--steps 2] [--tokens-per-device 32768]

Question: at a fixed number of tokens per device per step, how does the dropped fraction
of token-assignments grow with context length (512, 2K, 8K, 32K), for each place a
capacity can sit, and how much of it does bias balancing remove?

1. Routers: the tiny preset (8 experts, top-2, 2 MoE layers, 300 steps) trained twice,
   exactly as bench/balance.py trains `aux_loss` (softmax, aux weight 0.01) and
   `bias_sign` (sigmoid, no aux loss, sign rule at rate 0.01; chosen over bias_quantile:
   of the two bias rules within 0.5% of the aux run's val loss it has the flatter load,
   and QB at rate 0.1 costs +1.2%: see bench/results/balance_tiny/balance_tiny.json). The
   runs live in runs/bench/balance/ and are reused when finished. A third "router" is
   `moe.uniform_routing` (position s -> experts (s*K + j) mod E): the perfectly balanced
   floor, which must drop nothing at capacity factor >= 1.
2. Each step of a context L holds 8 x tokens_per_device tokens: 8 * T / L sequences,
   distinct non-overlapping L-token windows of the train split drawn without replacement
   (the val split has ~60K tokens; one step here needs 256K). Every MoE layer's routing
   is recorded. The model was trained on 128-token windows, and full attention over 32K
   positions needs O(L^2) memory, so each row is routed 128-token window by window; RoPE
   would accept longer windows, but routing stats would then rest on positions the model
   never saw. What changes with L is exactly what drops depend on: how many independent
   stretches of text share one capacity group.
3. The routing is dispatched by moelab's own expert-parallel code under
   `jax.shard_map` on a mesh of expert=8 (one expert per device, each device its
   8 * T / L / 8 sequences), with 1-wide experts (only the counts matter), for
     capacity/sequence  `capacity`: one capacity group per sequence
     capacity/local     `pooled`, pool_size 0: the device's local batch is the group
     pooled_wave        capacity pooled at the receiving expert over all 8 senders,
                        sender transport block at the same capacity factor
     pooled_wave/send2  the same with send_capacity_factor 2 (Marin sizes the sender's
                        transport block apart from the expert's capacity)
     pooled_wave/nosend the same with send_capacity_factor 8 (no sender cut): a pure
                        global pool, the floor of any capacity at that factor
     dropless           nothing dropped by construction (counted all the same)
   at capacity factors 1.0 and 1.25.

Drop counts are deterministic, so the machine's load does not change them. Prints a
table; writes bench/results/token_dropping/token_dropping.{json,png}.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from balance import METHODS, finished  # noqa: E402
from machine import run_main  # noqa: E402

from moelab.config import MeshConfig, MoEConfig, data_dir, load_config  # noqa: E402
from moelab.data.loader import read_meta  # noqa: E402
from moelab.data.shards import shard_path  # noqa: E402
from moelab.model.dispatch import Experts  # noqa: E402
from moelab.model.dispatch.dropless import dropless_dispatch  # noqa: E402
from moelab.model.layers import rope_angles  # noqa: E402
from moelab.model.moe import MoE  # noqa: E402
from moelab.model.router import Routing, route, uniform_choice  # noqa: E402
from moelab.parallel.expert import ExpertParallelDispatch  # noqa: E402
from moelab.parallel.mesh import make_mesh  # noqa: E402
from moelab.train.checkpoint import load_latest  # noqa: E402
from moelab.train.cli import config_path  # noqa: E402
from moelab.train.trainer import train  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "token_dropping"
RUNS = Path("runs/bench/balance")
ROUTERS = ("aux_loss", "bias_sign")  # trained; "uniform" is added as the floor
CONTEXTS = (512, 2048, 8192, 32768)
DEVICES = 8
FACTORS = (1.0, 1.25)
MODES = {  # name -> (dispatch, send_capacity_factor or None = the capacity factor)
    "capacity/sequence": ("capacity", None),
    "capacity/local": ("pooled", None),
    "pooled_wave": ("pooled_wave", None),
    "pooled_wave/send2": ("pooled_wave", 2.0),
    "pooled_wave/nosend": ("pooled_wave", float(DEVICES)),
    "dropless": ("dropless", None),
}


def trained_router(name: str, steps: int):
    run = RUNS / name
    if not finished(run, steps):
        train(load_config(config_path("tiny"), {**METHODS[name], "train.steps": steps}), run)
    model, cfg, _ = load_latest(run)
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


def windows(data_dir: str, length: int, count: int, seed: int) -> np.ndarray:
    """`count` distinct non-overlapping `length`-token windows of the train split, drawn
    without replacement over all sources (so each source in proportion to its size)."""
    streams = [np.load(shard_path(data_dir, s, "train"), mmap_mode="r")
               for s in read_meta(data_dir)["sources"]]
    index = [(i, j) for i, t in enumerate(streams) for j in range(len(t) // length)]
    if count > len(index):
        raise SystemExit(f"the train split holds {len(index)} windows of {length} tokens; "
                         f"{count} are needed: lower --steps or --tokens-per-device")
    picked = np.random.default_rng(seed).choice(len(index), count, replace=False)
    return np.stack([streams[i][j * length:(j + 1) * length] for i, j in
                     (index[p] for p in picked)]).astype(np.int32)


def route_rows(model, rows: np.ndarray, window: int, chunk: int = 256) -> np.ndarray:
    """Experts [L_moe, R, L, K] of rows [R, L], routed `window` tokens at a time."""
    r, length = rows.shape
    flat = rows.reshape(-1, window)
    parts = [np.asarray(routed_experts(model, jnp.asarray(flat[i:i + chunk])))
             for i in range(0, len(flat), chunk)]
    return np.concatenate(parts, axis=1).reshape(len(parts[0]), r, length, -1)


def uniform_rows(shape: tuple[int, int], top_k: int, n_experts: int) -> np.ndarray:
    """`moe.uniform_routing`'s experts for rows [R, L], as one layer [1, R, L, K]."""
    return np.asarray(uniform_choice(shape, top_k, n_experts)[0])[None]


@partial(jax.jit, static_argnums=(1, 2))
def ep_drops(experts: jax.Array, moe: MoEConfig, dispatch: ExpertParallelDispatch,
             tiny: Experts) -> tuple[jax.Array, jax.Array]:
    """(sender, receiver) drops of routing [B, L, K] through the expert-parallel dispatch."""
    routing = Routing(experts, jnp.ones(experts.shape, jnp.float32))
    _, dropped = dispatch(jnp.zeros((*experts.shape[:2], 1)), routing, tiny, moe)
    return dropped.sender, dropped.receiver


@partial(jax.jit, static_argnums=1)
def dropless_drops(experts: jax.Array, moe: MoEConfig, tiny: Experts) -> jax.Array:
    routing = Routing(experts, jnp.ones(experts.shape, jnp.float32))
    return dropless_dispatch(jnp.zeros((*experts.shape[:2], 1)), routing, tiny, moe)[1].total


def max_over_mean(counts: np.ndarray) -> float:
    """Mean over groups of max/mean expert load; counts [..., E]."""
    return float(np.mean(counts.max(-1) / counts.mean(-1)))


def load_stats(experts: np.ndarray, n_experts: int) -> dict:
    """Load imbalance [B, L, K] at each grouping a capacity can use."""
    per_seq = np.stack([np.bincount(e.ravel(), minlength=n_experts) for e in experts])
    per_device = per_seq.reshape(DEVICES, -1, n_experts).sum(1)
    return {"sequence": max_over_mean(per_seq), "device": max_over_mean(per_device),
            "global": max_over_mean(per_device.sum(0))}


def drop_fractions(experts: np.ndarray, n_experts: int, dispatch: ExpertParallelDispatch,
                   tiny: Experts) -> dict:
    """Every mode x factor: dropped fraction (and the sender part) of routing [B, L, K]."""
    e = jnp.asarray(experts)
    out = {}
    for cf in FACTORS:
        for mode, (kind, send_cf) in MODES.items():
            moe = MoEConfig(n_experts=n_experts, top_k=experts.shape[-1], dispatch=kind,
                            capacity_factor=cf, send_capacity_factor=send_cf or cf)
            if kind == "dropless":
                sender, receiver = 0, int(dropless_drops(e, moe, tiny))
            else:
                sender, receiver = (int(a) for a in ep_drops(e, moe, dispatch, tiny))
            out[f"{mode} cf{cf}"] = {"drop": (sender + receiver) / experts.size,
                                     "sender": sender / experts.size}
    return out


def mean_of(records: list[dict]) -> dict:
    """Elementwise mean of nested dicts of floats."""
    first = records[0]
    if isinstance(first, dict):
        return {k: mean_of([r[k] for r in records]) for k in first}
    return round(float(np.mean(records)), 6)


def measure(routers: dict, data_dir: str, window: int, tokens: int, steps: int,
            dispatch: ExpertParallelDispatch) -> dict:
    """router -> context -> layer-mean drop fractions, per layer, and load imbalance."""
    n_experts, top_k = 8, 2
    tiny = Experts.init(n_experts, 1, 1, 0.0, jax.random.key(0))
    out = {name: {} for name in (*routers, "uniform")}
    for length in CONTEXTS:
        rows = DEVICES * tokens // length
        text = windows(data_dir, length, rows * steps, seed=length)
        for name in out:
            per_layer = []  # [steps * layers] records
            for step in range(steps):
                batch = text[step * rows:(step + 1) * rows]
                layers = (route_rows(routers[name], batch, window) if name in routers
                          else uniform_rows(batch.shape, top_k, n_experts))
                per_layer.append([{"drops": drop_fractions(e, n_experts, dispatch, tiny),
                                   "max_over_mean_load": load_stats(e, n_experts)}
                                  for e in layers])
            layer_means = [mean_of([s[i] for s in per_layer]) for i in range(len(per_layer[0]))]
            out[name][str(length)] = {"sequences_per_device": rows // DEVICES,
                                      "mean": mean_of(layer_means), "per_layer": layer_means}
            print(f"  {name} L={length}: " + ", ".join(
                f"{m} {100 * v['drop']:.2f}%" for m, v in out[name][str(length)]["mean"][
                    "drops"].items() if m.endswith("cf1.0")), flush=True)
    return out


def plot(table: dict, path: Path, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.0), sharey=True)
    for ax, name in zip(axes, names, strict=True):
        for i, mode in enumerate(m for m in MODES if m != "dropless"):
            for cf, style in zip(FACTORS, ("-", "--"), strict=True):
                ax.plot(CONTEXTS, [100 * table[name][str(c)]["mean"]["drops"][f"{mode} cf{cf}"]
                                   ["drop"] for c in CONTEXTS], style, marker="o",
                        color=f"C{i}", label=f"{mode} cf{cf}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONTEXTS, [f"{c // 1024}K" if c >= 1024 else str(c) for c in CONTEXTS])
        ax.set_title(f"router: {name}", fontsize=9)
        ax.set_xlabel("context length")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dropped token-assignments (%)")
    axes[-1].legend(fontsize=7, loc="center")  # the uniform floor panel is empty
    fig.suptitle(f"8 experts top-2 on 8 expert-parallel devices, {tokens} tokens/device/step",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router-steps", type=int, default=300, help="tiny preset length")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per context")
    parser.add_argument("--tokens-per-device", type=int, default=32768)
    args = parser.parse_args()
    assert len(jax.devices()) == DEVICES, "XLA_FLAGS must be set before jax is imported"
    started = time.time()
    routers, cfgs = {}, {}
    for name in ROUTERS:
        routers[name], cfgs[name] = trained_router(name, args.router_steps)
    trained_s = time.time() - started
    cfg = cfgs[ROUTERS[0]]
    dispatch = ExpertParallelDispatch(make_mesh(MeshConfig(expert=DEVICES)), "padded")
    table = measure(routers, data_dir(cfg.data.path), cfg.data.seq_len, args.tokens_per_device,
                    args.steps, dispatch)
    result = {
        "question": "dropped fraction of token-assignments vs context length at fixed tokens "
                    "per device per step, on 8 expert-parallel devices",
        "routers": {name: {"run_dir": str(RUNS / name), "steps": args.router_steps,
                           "overrides": METHODS[name],
                           "moe": dataclasses.asdict(cfgs[name].moe)} for name in ROUTERS},
        "routing_window": cfg.data.seq_len, "devices": DEVICES, "mesh": "expert=8",
        "tokens_per_device_per_step": args.tokens_per_device, "steps_per_context": args.steps,
        "modes": {m: {"dispatch": d, "send_capacity_factor": s or "= capacity_factor"}
                  for m, (d, s) in MODES.items()},
        "factors": list(FACTORS),
        "routers_x_contexts": table,
        "seconds": {"train_or_load": round(trained_s, 1),
                    "measure": round(time.time() - started - trained_s, 1)},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "token_dropping.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(table, RESULTS / "token_dropping.png", args.tokens_per_device)
    columns = [f"{m} cf{cf}" for cf in FACTORS for m in MODES if m != "dropless"]
    print(f"{'router':>10} {'ctx':>6} {'seq/dev':>7} " + " ".join(f"{c:>26}" for c in columns))
    for name, per_context in table.items():
        for length, row in per_context.items():
            print(f"{name:>10} {length:>6} {row['sequences_per_device']:>7} " + " ".join(
                f"{100 * row['mean']['drops'][c]['drop']:>25.2f}%" for c in columns))


if __name__ == "__main__":
    run_main(main)
