"""Forward+backward time of one MoE layer per dispatch mode vs a dense masked baseline.

    python3 bench/moe_layer.py [--batch 8] [--seq 256] [--reps 7]

One `MoE` layer (router, top-k routing, dispatch, experts) with the same weights and
input in every mode; each rep computes its output, a scalar loss sum(y * g), and the
gradients of every layer weight and of the input, under jit. Modes:
  capacity  capacity per sequence (capacity_factor 1.25), pooled  one pool per batch,
  dropless  sorted rows, blocked matmuls (the CPU kernel), dropless_slab (each expert's
            balanced share of rows as one batched matmul, the rest blocked), and
            dropless ragged_dot,
  dense     the baseline: every expert on every token, outputs masked by the routing
            weights (0 for unchosen experts) and summed: E/top_k times the FLOPs.
  swiglu_equal_active_flops  the limit: one dense SwiGLU of hidden width top_k * d_ff on
            every token, the same active FLOPs as the MoE without routing or dispatch.
Where the gap between dropless and that limit sits, with routing made exactly uniform
(`moe.uniform_routing`: every expert gets batch * seq * top_k / experts rows):
  dropless_uniform  the CPU kernel: data-dependent loops of 2-D matmuls over the runs,
  batched_uniform   the same sorted rows as one [E, rows / E, D] batch through XLA's own
            batched einsum (static shapes, no loop; valid only because the runs are equal).
dropless_uniform / batched_uniform is what the kernel's loops cost over XLA's product of
the same shapes; batched_uniform / swiglu_equal_active_flops is what running E products of
[rows / E, D] @ [D, d_ff] costs against one [tokens, D] @ [D, top_k * d_ff].
Reps of all modes alternate after warmup, so load from other processes hits them
alike; medians and their ratio to dense are printed and written to
bench/results/benchmarks/moe_layer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from blocks import add_shape_args, inputs, shapes  # bench/blocks.py
from machine import add_output_args, describe, load_per_core, refuse_if_busy, settle, timed

from moelab.config import ModelConfig, MoEConfig
from moelab.model.dispatch import Drops, Experts, get_dispatch
from moelab.model.dispatch.dropless import sorted_dispatch
from moelab.model.moe import MoE
from moelab.model.router import Routing
from moelab.parallel.expert import with_dispatch

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "moe_layer.json"


def dense_dispatch(x, routing: Routing, experts: Experts, moe: MoEConfig):
    """y = sum_e mask[t, e] * expert_e(x_t): every expert computes every token."""
    b, s, d = x.shape
    tokens = x.reshape(1, b * s, d)
    every = experts(jnp.broadcast_to(tokens, (moe.n_experts, b * s, d)))  # [E, T, D]
    mask = jnp.sum(jax.nn.one_hot(routing.experts, moe.n_experts)
                   * routing.weights[..., None], axis=2).reshape(b * s, moe.n_experts)
    y = jnp.einsum("te,etd->td", mask.astype(x.dtype), every).reshape(x.shape)
    return y, Drops.at_expert(0)


def swiglu_dispatch(x, routing: Routing, experts: Experts, moe: MoEConfig):
    """A dense SwiGLU with the active FLOPs of top_k experts: the first top_k experts'
    weights side by side (hidden width top_k * d_ff), on every token, no routing."""
    k, (b, s, d) = moe.top_k, x.shape
    gate = jnp.concatenate(list(experts.w_gate[:k]), axis=-1)  # [D, k*F]
    up = jnp.concatenate(list(experts.w_up[:k]), axis=-1)
    down = jnp.concatenate(list(experts.w_down[:k]), axis=0)  # [k*F, D]
    tokens = x.reshape(b * s, d)
    y = (jax.nn.silu(tokens @ gate) * (tokens @ up)) @ down
    return y.reshape(x.shape), Drops.at_expert(0)


def batched_dispatch(x, routing: Routing, experts: Experts, moe: MoEConfig):
    """Dropless with every expert's run as one static [E, rows / E, D] batch: exact only
    when the runs are equal (uniform routing)."""
    d = x.shape[-1]
    compute = lambda rows, s: experts(rows.reshape(moe.n_experts, -1, d)).reshape(-1, d)
    return sorted_dispatch(x, routing, compute, moe), Drops.at_expert(0)


MODES = {  # name -> (MoEConfig changes, dispatch override)
    "capacity": ({"dispatch": "capacity", "capacity_factor": 1.25}, None),
    "pooled": ({"dispatch": "pooled", "capacity_factor": 1.25}, None),
    "dropless": ({"dispatch": "dropless", "dropless_impl": "blocked"}, None),
    "dropless_slab": ({"dispatch": "dropless", "dropless_impl": "slab"}, None),
    "dropless_ragged_dot": ({"dispatch": "dropless", "dropless_impl": "ragged"}, None),
    "dense": ({"dispatch": "dropless"}, dense_dispatch),
    "swiglu_equal_active_flops": ({"dispatch": "dropless"}, swiglu_dispatch),
    "dropless_uniform": ({"dispatch": "dropless", "dropless_impl": "blocked",
                          "uniform_routing": True}, None),
    "batched_uniform": ({"dispatch": "dropless", "uniform_routing": True}, batched_dispatch),
}


def layer_for(mode: str, args: argparse.Namespace) -> MoE:
    changes, override = MODES[mode]
    moe = MoEConfig(n_experts=args.experts, top_k=args.top_k, **changes)
    model = ModelConfig(d_model=args.d_model, d_ff=args.d_ff, init_std=args.init_std)
    layer = eqx.filter_jit(MoE.init)(model, moe, jax.random.key(0))  # same key: same weights
    return with_dispatch(layer, override or get_dispatch(moe))


def step_of(layer: MoE, x, g):
    """A call running one jitted forward+backward; returns (y, drop_frac, dx)."""
    params, static = eqx.partition(layer, eqx.is_array)

    @jax.jit
    def step(params, x):
        def loss(params, x):
            y, stats = eqx.combine(params, static)(x)
            return jnp.sum(y * g), (y, stats.drop_frac)

        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return aux, grads

    def call():
        (y, drop), (_, dx) = jax.block_until_ready(step(params, x))
        return np.asarray(y), float(drop), np.asarray(dx)

    return call


def run(args: argparse.Namespace) -> dict:
    load_before, waited = settle()
    x, g = inputs(args)
    calls = {mode: step_of(layer_for(mode, args), x, g) for mode in MODES}
    first = {mode: call() for mode, call in calls.items()}  # compile + first warmup
    y_dense = first["dense"][0]
    check = {mode: {"drop_frac": drop,
                    "max_abs_diff_y_vs_dense": float(np.max(np.abs(y - y_dense)))}
             for mode, (y, drop, _) in first.items()}
    for mode in ("dropless", "dropless_ragged_dot"):
        if check[mode]["max_abs_diff_y_vs_dense"] > 1e-4:
            raise SystemExit(f"{mode} disagrees with dense: {check[mode]}")
    uniform = float(np.max(np.abs(first["batched_uniform"][0] - first["dropless_uniform"][0])))
    check["batched_uniform"]["max_abs_diff_y_vs_dropless_uniform"] = uniform
    if uniform > 1e-4:  # float32 sums of 256 products of O(1e-2) terms: ~1e-7 apart
        raise SystemExit(f"batched_uniform disagrees with dropless_uniform: {uniform:.2e}")
    for _ in range(args.warmup - 1):
        for call in calls.values():
            call()
    times = {mode: [] for mode in calls}
    for _ in range(args.reps):
        for mode, call in calls.items():
            times[mode].append(timed(call))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "layer": "one MoE FFN layer: router + top-k + dispatch + SwiGLU experts",
        "pass": "forward + backward (grads of all layer weights and of the input), jit",
        "shapes": shapes(args),
        "dtype": "float32", "backend": jax.default_backend(), "jax": jax.__version__,
        "capacity_factor": 1.25, "block_size": MoEConfig().block_size,
        "check": check, "warmup": args.warmup, "reps": args.reps,
        "seconds": {k: [round(t, 5) for t in v] for k, v in times.items()},
        "median_ms": {k: round(1e3 * v, 2) for k, v in median.items()},
        # the fastest rep: on a shared VM the loop kernel's reps can switch between two
        # speeds while the static-shape modes beside them do not (see the README)
        "min_ms": {k: round(1e3 * min(v), 2) for k, v in times.items()},
        "ratio_dense_over_mode": {k: round(median["dense"] / v, 3) for k, v in median.items()},
        # speed relative to a dense SwiGLU doing the same active FLOPs: 1.0 = no MoE overhead
        "ratio_swiglu_over_mode": {k: round(median["swiglu_equal_active_flops"] / v, 3)
                                   for k, v in median.items()},
        "gap_to_swiglu": {  # the dropless / swiglu ratio, factored (uniform routing)
            "kernel_loops_over_batched_einsum": round(
                median["dropless_uniform"] / median["batched_uniform"], 3),
            "batched_einsum_over_swiglu": round(
                median["batched_uniform"] / median["swiglu_equal_active_flops"], 3)},
        "machine": describe(load_before, load_per_core(), waited),
    }
    refuse_if_busy(result["machine"], args.force)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<26}{'median ms':>10}{'min ms':>8}{'dense/mode':>12}{'drop frac':>11}")
    for mode in MODES:
        print(f"{mode:<26}{1e3 * median[mode]:>10.1f}{1e3 * min(times[mode]):>8.1f}"
              f"{result['ratio_dense_over_mode'][mode]:>12.2f}{check[mode]['drop_frac']:>11.4f}")
    gap = result["gap_to_swiglu"]
    print(f"time ratios under uniform routing: kernel loops / batched einsum "
          f"{gap['kernel_loops_over_batched_einsum']:.3f}, batched einsum / dense SwiGLU "
          f"{gap['batched_einsum_over_swiglu']:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser, heads=False)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--reps", type=int, default=7)
    add_output_args(parser, RESULTS)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
