"""What the block and layer benches share: their shape options, their inputs, and one
jitted forward + backward of a decoder block (bench/vs_transformers.py,
bench/moe_block_bounds.py; bench/moe_layer.py takes the options without the heads).

Every bench times the same shape by default (B8 S256 D256, 4 query and 2 KV heads,
E8 top-2, d_ff 512, float32), so their numbers can be read side by side.
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model.layers import rope_angles


def add_shape_args(parser: argparse.ArgumentParser, heads: bool = True) -> None:
    """The shape options (and --warmup) every block and layer bench takes."""
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=256)
    if heads:
        parser.add_argument("--heads", type=int, default=4)
        parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)


def block_model(args: argparse.Namespace) -> ModelConfig:
    """One decoder layer of the options' shape (the vocabulary is never used)."""
    return ModelConfig(vocab_size=512, d_model=args.d_model, n_layers=1, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, d_ff=args.d_ff)


def shapes(args: argparse.Namespace) -> dict:
    """The options' shape, as the result files record it."""
    names = ("batch", "seq", "d_model", "heads", "kv_heads", "experts", "top_k", "d_ff")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def inputs(args: argparse.Namespace) -> tuple[jax.Array, jax.Array]:
    """The input x and the output cotangent g (loss = sum(out * g)), both [B, S, D]."""
    kx, kg = jax.random.split(jax.random.key(1))
    shape = (args.batch, args.seq, args.d_model)
    return jax.random.normal(kx, shape), jax.random.normal(kg, shape)


def rope(args: argparse.Namespace, model: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """RoPE's cos and sin at positions 0..seq-1 of every sequence."""
    positions = jnp.broadcast_to(jnp.arange(args.seq), (args.batch, args.seq))
    return rope_angles(positions, model.resolved_head_dim, model.rope_theta)


def block_step(block, x, g, cos, sin):
    """A call running one jitted forward + backward of the block; it returns
    (loss, (grads of the weights, grad of the input)), computed."""
    params, static = eqx.partition(block, eqx.is_array)

    @jax.jit
    def step(params, x, g, cos, sin):
        def loss(params, x):
            out, _, _ = eqx.combine(params, static)(x, cos, sin)
            return jnp.sum(out * g)

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    return lambda: jax.block_until_ready(step(params, x, g, cos, sin))
