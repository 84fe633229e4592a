"""Forward+backward time of one MoE decoder block: moelab (JAX, dropless) vs transformers.

    python3 bench/vs_transformers.py [--batch 8] [--seq 256] [--reps 15]

The block is a whole decoder layer, attention and MoE FFN (pre-norm, residual):
moelab's `Block` and the `Qwen3MoeDecoderLayer` that `moelab export` turns it into, with
the same weights (loaded from the exported directory, so the conversion is timed on the
real path) and the same input. Both run in this process on CPU in float32; the output is
checked equal before timing. Each rep computes the block's output, a scalar loss
sum(out * g), and its gradients with respect to every weight and the input. Reps of the
two alternate, after warmup, so load from other processes hits both alike, with a pause
whenever the library changes (one library's threads spin on after a call and slowed the
other's next call) and an untimed call after it; the medians and their ratio are
printed and written to bench/results/benchmarks/vs_transformers.json. (Running transformers in a
child process instead, so that the two libraries' thread pools never share a process,
did not change the ratios: MoE / dense 0.92 and 0.91 paired in two runs against 0.94 in
one process, within this VM's run-to-run spread.)

Beside the two, the limit: moelab's block with the MoE replaced by a dense SwiGLU of the
same active FLOPs (width top_k * d_ff, no router, no dispatch), timed in the same
alternation, and every block's matmul FLOP/s against this machine's float32 matmul peak
(a 2048^2 jnp.dot timed in this run). The dense block is what no dispatch can beat, so
transformers / dense bounds the speed-up any MoE dispatch on this backend can reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from blocks import add_shape_args, block_model, block_step, inputs, rope, shapes  # bench/
from machine import (
    add_output_args,
    describe,
    load_per_core,
    matmul_peak,
    paired_ratio,
    refuse_if_busy,
    settle,
    timed,
)

from moelab.config import Config, MoEConfig
from moelab.export.hf import export_hf
from moelab.model import Transformer
from moelab.model.transformer import Block

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "vs_transformers.json"
# Between the JAX blocks and PyTorch's. PyTorch's threads keep spinning for a while after
# a call and slow what runs next, most of all the MoE kernel's loops of small ops (one
# run, 25 reps, machine B: after a 0.3 s pause the MoE block took 145.8 ms against its
# dense equal's 114.2; after 1.0 s, 118.5 against 113.0; with OMP_WAIT_POLICY=PASSIVE,
# 117.2 against 111.5, but PyTorch's own block 5% slower).
LIBRARY_PAUSE_S = 1.0


def build(args: argparse.Namespace) -> tuple[Config, Transformer]:
    moe = MoEConfig(n_experts=args.experts, top_k=args.top_k, dispatch="dropless")
    cfg = Config(model=block_model(args), moe=moe)
    return cfg, Transformer.init(cfg.model, cfg.moe, jax.random.key(0))


def block_flops(args: argparse.Namespace, head_dim: int, routed: bool) -> float:
    """Matmul FLOPs of one block, forward + backward (the backward is twice the forward):
    q/k/v/o projections, attention scores and values over the full causal square (as
    transformers' sdpa computes them; moelab skips the fully masked chunks, ~3/8 at S 256,
    and is still charged for them, so the fractions of peak compare like with like), the
    router, and top_k experts' SwiGLU per token (= the dense SwiGLU of width top_k * d_ff)."""
    tokens = args.batch * args.seq
    q, kv = args.heads * head_dim, args.kv_heads * head_dim
    projections = 2 * tokens * args.d_model * (2 * q + 2 * kv)
    attention = 2 * 2 * args.batch * args.heads * args.seq**2 * head_dim
    router = 2 * tokens * args.d_model * args.experts if routed else 0
    ffn = 2 * 3 * tokens * args.top_k * args.d_model * args.d_ff
    return 3.0 * (projections + attention + router + ffn)


def moelab_step(block, x, g, cos, sin):
    """A call that runs one jit-compiled forward+backward; returns (loss, dx)."""
    step = block_step(block, x, g, cos, sin)

    def call():
        loss, (_, dx) = step()
        return float(loss), np.asarray(dx)

    return call


def transformers_step(layer, rotary, x, g):
    """A call that runs one eager forward+backward of the HF layer; returns (loss, dx)."""
    x = torch.tensor(np.asarray(x), requires_grad=True)
    g = torch.tensor(np.asarray(g))
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = rotary(x, positions)
    layer.train()  # as in training (dropout is 0 either way)

    def call():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x, attention_mask=None, position_ids=positions,
                    position_embeddings=(cos, sin))
        loss = torch.sum(out * g)
        loss.backward()
        return loss.item(), x.grad.detach().numpy().copy()

    return call


def load_transformers(hf_dir: str, x, g) -> tuple:
    """transformers' block from the exported directory: (its call, what the results record
    about it)."""
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    info = {"version": transformers.__version__, "torch": torch.__version__,
            "experts_implementation": hf.config._experts_implementation,
            "attn_implementation": hf.config._attn_implementation,
            "torch_threads": torch.get_num_threads()}
    return transformers_step(hf.model.layers[0], hf.model.rotary_emb, x, g), info


def run(args: argparse.Namespace) -> dict:
    load_before, waited = settle()
    cfg, model = build(args)
    x, g = inputs(args)
    with tempfile.TemporaryDirectory() as tmp:
        theirs, info = load_transformers(str(export_hf(model, cfg, Path(tmp) / "hf")), x, g)
    cos, sin = rope(args, cfg.model)
    ours = moelab_step(model.blocks[0], x, g, cos, sin)
    dense = moelab_step(Block.init(cfg.model, cfg.moe, True, jax.random.key(2)), x, g, cos, sin)
    # the two JAX blocks side by side, then PyTorch's, with a pause (LIBRARY_PAUSE_S) each
    # time the library changes, so that one's spinning threads do not slow the other
    calls = {"moelab": ours, "moelab_dense_equal_flops": dense, "transformers": theirs}

    (loss_a, dx_a), (loss_b, dx_b) = ours(), theirs()  # also the first warmup
    dx_err = float(np.max(np.abs(dx_a - dx_b)))
    if dx_err > 1e-3 * max(1.0, float(np.max(np.abs(dx_b)))):
        raise SystemExit(f"the two blocks disagree: max |d loss/dx| error {dx_err:.2e}")
    dense()
    for _ in range(args.warmup - 1):
        for call in calls.values():
            call()
    times = {k: [] for k in calls}
    jax_blocks = ["moelab", "moelab_dense_equal_flops"]
    for rep in range(args.reps):  # alternate, so background load hits all alike
        # cores idle through the pause run slower for a while on these VMs: an untimed
        # call wakes them, and the two JAX blocks take turns to go first
        dense()
        for k in jax_blocks[rep % 2:] + jax_blocks[:rep % 2]:
            times[k].append(timed(calls[k]))
        time.sleep(LIBRARY_PAUSE_S)
        theirs()  # the same for PyTorch
        times["transformers"].append(timed(theirs))
        time.sleep(LIBRARY_PAUSE_S)
    median = {k: statistics.median(v) for k, v in times.items()}
    peak = matmul_peak()
    head_dim = cfg.model.resolved_head_dim
    flops = {"moelab": block_flops(args, head_dim, True),
             "transformers": block_flops(args, head_dim, True),
             "moelab_dense_equal_flops": block_flops(args, head_dim, False)}
    need = median["transformers"] / 1.5
    result = {
        "block": "decoder layer: RMSNorm + GQA attention (QK-norm, RoPE) + RMSNorm + MoE FFN",
        "pass": "forward + backward (grads of all block weights and of the input)",
        "shapes": {**shapes(args), "head_dim": cfg.model.resolved_head_dim},
        "dtype": "float32",
        "moelab": {"dispatch": "dropless", "kernel": "ragged" if jax.default_backend() != "cpu"
                   else f"blocked (block_size {cfg.moe.block_size})",
                   "backend": jax.default_backend(), "jax": jax.__version__},
        "transformers": info,
        "check": {"loss_moelab": loss_a, "loss_transformers": loss_b,
                  "max_abs_err_dloss_dx": dx_err},
        "warmup": args.warmup, "reps": args.reps,
        "protocol": f"each rep: an untimed dense-block call, the two JAX blocks timed in "
                    f"turns, a {LIBRARY_PAUSE_S} s pause, an untimed then a timed "
                    f"transformers call, a {LIBRARY_PAUSE_S} s pause",
        "seconds": {k: [round(t, 5) for t in v] for k, v in times.items()},
        "median_ms": {k: round(1e3 * v, 2) for k, v in median.items()},
        "ratio_transformers_over_moelab": round(median["transformers"] / median["moelab"], 3),
        "paired": {  # each rep's own ratio, the median over reps (machine.paired_ratio)
            "transformers_over_moelab": round(
                paired_ratio(times["transformers"], times["moelab"]), 3),
            "moelab_speed_vs_dense": round(
                paired_ratio(times["moelab_dense_equal_flops"], times["moelab"]), 3)},
        "limit": {
            "what": "moelab's block with a dense SwiGLU of equal active FLOPs in place of the "
                    "MoE: no router, no dispatch",
            "ratio_transformers_over_dense": round(
                median["transformers"] / median["moelab_dense_equal_flops"], 3),
            "ratio_moelab_over_dense_time": round(
                median["moelab"] / median["moelab_dense_equal_flops"], 3)},
        "matmul_peak_flops_per_s": peak,
        "block_flops": flops,
        "fraction_of_matmul_peak": {k: round(flops[k] / median[k] / peak, 3) for k in calls},
        "for_1.5x": {"moelab_ms": round(1e3 * need, 2),
                     "fraction_of_matmul_peak": round(flops["moelab"] / need / peak, 3)},
        "machine": describe(load_before, load_per_core(), waited),
    }
    refuse_if_busy(result["machine"], args.force)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"moelab {median['moelab'] * 1e3:.1f} ms, transformers "
          f"{median['transformers'] * 1e3:.1f} ms, moelab dense equal-FLOP "
          f"{median['moelab_dense_equal_flops'] * 1e3:.1f} ms (median of {args.reps}): "
          f"transformers / moelab = {result['ratio_transformers_over_moelab']:.2f}, "
          f"transformers / dense = {result['limit']['ratio_transformers_over_dense']:.2f}; "
          f"fraction of the {peak / 1e9:.0f} GFLOP/s matmul peak: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["fraction_of_matmul_peak"].items())
          + f"; 1.5x needs {result['for_1.5x']['fraction_of_matmul_peak']:.2f}")
    print(f"median of each rep's own ratio: transformers / moelab "
          f"{result['paired']['transformers_over_moelab']:.3f}, moelab's speed vs its dense "
          f"equal {result['paired']['moelab_speed_vs_dense']:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--reps", type=int, default=15)
    add_output_args(parser, RESULTS)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
