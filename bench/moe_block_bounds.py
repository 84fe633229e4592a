"""Where one MoE block's extra time over its dense equal goes, and what bounds it on CPU.

    python3 bench/moe_block_bounds.py [--rounds 15] [--keep-freed-memory]

The block is bench/vs_transformers.py's (B8 S256 D256, 4 heads, E8 top-2, d_ff 512,
float32, forward + backward). Beside moelab's dense block (a SwiGLU of width
top_k * d_ff: equal active FLOPs) and its MoE block (dropless, the blocked and the slab
kernels), the same MoE block is timed with its dispatch replaced by idealised ones, each
doing the experts' FLOPs with one thing less to pay for:

  router_then_dense   the router and its losses, then a dense SwiGLU of width top_k * d_ff
                      on the tokens (no sort, no permutations, no combine)
  sorted_one_weight   sort, permute, unsort and combine as the MoE does, but every row
                      through one expert's weights as one 2-D product per matmul: a
                      perfect grouped GEMM that needs only one weight
  sorted_even_batched the sorted rows cut into E equal runs, one per expert, through
                      XLA's batched matmul: E weights, no routing skew, no loops
  sorted_even_split   the same E equal runs as E separate 2-D products of static shape

The idealised variants compute wrong numbers (they ignore the routing's group sizes);
they price each part of the MoE's extra time at this shape: the router, the sort and
permutations, the E separate weights, with and without XLA's loops. Beside them, the
rate of XLA's and OpenBLAS's (numpy) float32 GEMM at one expert's shape
([T*k/E, D] x [D, F]) and at the dense layer's ([T, D] x [D, k*F]):
how fast the E products can be, by which library (each library's calls back to back,
after a pause that lets the other's threads go idle).

Rounds alternate every variant, so background load hits all alike; the medians, each
variant's speed against the dense block, and the ms it adds over it are printed and
written to bench/results/benchmarks/moe_block_bounds.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from blocks import add_shape_args, block_model, block_step, inputs, rope, shapes  # bench/
from machine import (
    add_output_args,
    describe,
    load_per_core,
    paired_ratio,
    refuse_if_busy,
    settle,
    timed,
)

from moelab.config import MoEConfig
from moelab.model import Transformer
from moelab.model.dispatch.dropless import sorted_dispatch
from moelab.model.dispatch.drops import Drops
from moelab.model.transformer import Block
from moelab.train.memory import keep_freed_memory

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "moe_block_bounds.json"
GEMM_PAUSE_S = 0.5  # before each library's GEMMs: lets the other's spinning threads sleep
GEMM_CALLS = 9  # back to back; their median is a round's time


def swiglu(rows, w_gate, w_up, w_down):
    return (jax.nn.silu(rows @ w_gate) * (rows @ w_up)) @ w_down


def router_then_dense(x, routing, experts, moe):
    """The router and its losses, then the tokens through a dense SwiGLU of width
    top_k * d_ff (the first top_k experts side by side): no sort, no permutation."""
    k = moe.top_k
    wide = lambda w, axis: jnp.concatenate([w[i] for i in range(k)], axis)
    y = swiglu(x.reshape(-1, x.shape[-1]), wide(experts.w_gate, -1), wide(experts.w_up, -1),
               wide(experts.w_down, 0))
    return y.reshape(x.shape), Drops.at_expert(0)


def one_weight(rows, s, experts):
    """Sort, permute, unsort and combine as the MoE does; every row through one expert
    as one 2-D product per matmul: a perfect grouped GEMM that needs one weight."""
    return swiglu(rows, experts.w_gate[0], experts.w_up[0], experts.w_down[0])


def even_batched(rows, s, experts):
    """The sorted rows as E equal runs through XLA's batched matmul: E weights, no skew."""
    e = experts.w_gate.shape[0]
    runs = rows.reshape(e, -1, rows.shape[-1])
    return swiglu(runs, experts.w_gate, experts.w_up, experts.w_down).reshape(rows.shape)


def even_split(rows, s, experts):
    """The sorted rows as E equal runs, E separate 2-D products of static shape."""
    e = experts.w_gate.shape[0]
    n = rows.shape[0] // e
    return jnp.concatenate([swiglu(rows[i * n:(i + 1) * n], experts.w_gate[i],
                                   experts.w_up[i], experts.w_down[i]) for i in range(e)])


def blas_name() -> str:
    try:
        return np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except (KeyError, TypeError):
        return "unknown"


def sorted_with(compute):
    def dispatch(x, routing, experts, moe):
        rows_out = lambda rows, s: compute(rows, s, experts)
        return sorted_dispatch(x, routing, rows_out, moe), Drops.at_expert(0)

    return dispatch


IDEAL = {"router_then_dense": router_then_dense,
         "sorted_one_weight": sorted_with(one_weight),
         "sorted_even_batched": sorted_with(even_batched),
         "sorted_even_split": sorted_with(even_split)}


def gemm_calls(m: int, k: int, n: int) -> dict:
    """XLA's and numpy's (its BLAS: OpenBLAS in the wheels) float32 [m, k] x [k, n]
    product, each a call."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    dot = jax.jit(jnp.dot)
    return {"xla": lambda: dot(ja, jb).block_until_ready(), "numpy": lambda: a @ b}


def run(args: argparse.Namespace) -> dict:
    load_before, waited = settle()
    kept = keep_freed_memory() if args.keep_freed_memory else False
    model_cfg = block_model(args)
    blocks = {}
    for impl in ("blocked", "slab"):
        moe = MoEConfig(n_experts=args.experts, top_k=args.top_k, dispatch="dropless",
                        dropless_impl=impl)
        blocks[f"moe_{impl}"] = Transformer.init(model_cfg, moe, jax.random.key(0)).blocks[0]
    moe_block = blocks["moe_blocked"]
    with_dispatch = lambda d: eqx.tree_at(lambda b: b.ffn, moe_block,
                                          dataclasses.replace(moe_block.ffn, dispatch=d))
    # the dense block: a SwiGLU of width top_k * d_ff (Block.init reads only top_k)
    dense_moe = MoEConfig(n_experts=args.experts, top_k=args.top_k)
    blocks = {"dense": Block.init(model_cfg, dense_moe, True, jax.random.key(2)),
              **{name: with_dispatch(d) for name, d in IDEAL.items()}, **blocks}

    x, g = inputs(args)
    cos, sin = rope(args, model_cfg)
    calls = {name: block_step(b, x, g, cos, sin) for name, b in blocks.items()}
    tokens = args.batch * args.seq
    gemms = {"expert": (tokens * args.top_k // args.experts, args.d_model, args.d_ff),
             "dense": (tokens, args.d_model, args.top_k * args.d_ff)}
    gemm = {f"{shape_name}_{lib}": call for shape_name, mkn in gemms.items()
            for lib, call in gemm_calls(*mkn).items()}

    for _ in range(args.warmup):
        for call in calls.values():
            call()
    times = {k: [] for k in calls}
    for r in range(args.rounds):  # alternate, so background load hits all alike
        for k, call in calls.items():
            times[k].append(timed(call))
        print(f"[bench] round {r + 1}/{args.rounds}: "
              + ", ".join(f"{k} {1e3 * v[-1]:.0f}" for k, v in times.items()) + " ms",
              flush=True)

    # after the blocks, not among them: a BLAS's threads spin for a while after a call
    # and slowed whichever block came next (measured: the dense block by ~30 ms). One
    # library at a time, each after a pause, its calls back to back: XLA's small products
    # ran at half speed for several calls after a pause (its threads asleep)
    gemm_times = {k: [] for k in gemm}
    for lib in ("xla", "numpy"):
        time.sleep(GEMM_PAUSE_S)
        mine = {k: call for k, call in gemm.items() if k.endswith(lib)}
        for call in mine.values():
            call()
        for _ in range(args.rounds):
            for k, call in mine.items():
                gemm_times[k].append(statistics.median(timed(call) for _ in range(GEMM_CALLS)))

    median = {k: statistics.median(v) for k, v in times.items()}
    dense = median["dense"]

    def rate(name: str, t: float) -> float:
        m, k, n = gemms[name.split("_")[0]]
        return 2 * m * k * n / t / 1e9

    result = {
        "block": "decoder layer: RMSNorm + GQA attention (QK-norm, RoPE) + RMSNorm + FFN, "
                 "forward + backward, float32",
        "shapes": shapes(args),
        "keep_freed_memory": kept,
        "variants": {k: fn.__doc__ or "" for k, fn in IDEAL.items()},
        "numpy_blas": blas_name(),
        "rounds": args.rounds,
        "seconds": {k: [round(t, 5) for t in v] for k, v in times.items()},
        "median_ms": {k: round(1e3 * v, 2) for k, v in median.items()},
        "speed_vs_dense": {k: round(dense / v, 3) for k, v in median.items()},
        # each round's own ratio, the median over rounds (machine.paired_ratio)
        "speed_vs_dense_paired": {k: round(paired_ratio(times["dense"], v), 3)
                                  for k, v in times.items()},
        "ms_over_dense": {k: round(1e3 * (v - dense), 2) for k, v in median.items()},
        "gemm_gflop_per_s": {
            "shapes_mkn": gemms,
            **{k: {"median": round(rate(k, statistics.median(v)), 1),
                   "slowest": round(rate(k, max(v)), 1), "fastest": round(rate(k, min(v)), 1)}
               for k, v in gemm_times.items()}},
        "machine": describe(load_before, load_per_core(), waited),
    }
    refuse_if_busy(result["machine"], args.force)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for k in calls:
        print(f"{k:20s} {result['median_ms'][k]:7.1f} ms  {result['speed_vs_dense'][k]:.3f}x "
              f"dense ({result['speed_vs_dense_paired'][k]:.3f}x paired)  "
              f"{result['ms_over_dense'][k]:+6.1f} ms")
    for k in gemm:
        r = result["gemm_gflop_per_s"][k]
        print(f"GEMM {k:22s} {r['median']:6.1f} GFLOP/s median "
              f"({r['slowest']:.0f}-{r['fastest']:.0f})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="keep freed memory as the trainer does (moelab.train.memory)")
    add_output_args(parser, RESULTS)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
