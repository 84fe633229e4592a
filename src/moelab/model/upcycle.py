"""Sparse upcycling: an MoE whose every expert starts as a copy of a dense model's FFN.

Komatsuzaki et al. 2023 ("Sparse Upcycling"), as Megatron-Core's upcycling does it: the
embedding, attention, norms and output head are copied; each dense SwiGLU layer becomes an
MoE layer whose E experts are copies of it (plus a little Gaussian noise, `noise` times the
std of each layer's matrix, to break their symmetry); the router is initialised fresh.

With no noise the upcycled model computes the dense model exactly whenever the routed
weights sum to 1 (moe.normalize_top_k, routed_scaling 1, no shared expert): every expert
is the same function, so sum_k w_k FFN(x) = FFN(x) whatever the router chooses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from moelab.config import ModelConfig, MoEConfig
from moelab.model.dispatch.experts import Experts
from moelab.model.transformer import Transformer


def dense_width(dense: Transformer) -> int:
    """The hidden width of a dense model's SwiGLU layers (the upcycled experts' d_ff)."""
    return dense.dense_layers.ffn.w_gate.shape[-1]


def upcycled_config(dense: ModelConfig, width: int) -> ModelConfig:
    """The dense model's config with every layer sparse and experts `width` wide."""
    return dataclasses.replace(dense, n_dense_layers=0, d_ff=width, d_ff_dense=0)


def upcycle(dense: Transformer, cfg: ModelConfig, moe: MoEConfig, key: PRNGKeyArray,
            noise: float = 0.0) -> Transformer:
    """The MoE of `cfg` / `moe` (every layer sparse, experts dense_width(dense) wide)
    upcycled from `dense`, a model whose every layer is dense."""
    if dense.moe_layers is not None or dense.dense_layers is None:
        raise ValueError("upcycle takes a model whose every layer is dense")
    if cfg.n_dense_layers or cfg.d_ff != dense_width(dense):
        raise ValueError(f"the upcycled model needs n_dense_layers 0 and d_ff "
                         f"{dense_width(dense)} (the dense FFN's width)")
    k_init, *k_noise = jax.random.split(key, 4)
    fresh = Transformer.init(cfg, moe, k_init)  # its routers (and selection biases) stay
    ffn = dense.dense_layers.ffn

    def copies(w, k):  # [L, A, B] -> [L, E, A, B], each copy with its own noise
        spread = jnp.std(w, axis=(-2, -1), keepdims=True)[:, None]
        stacked = jnp.broadcast_to(w[:, None], (w.shape[0], moe.n_experts, *w.shape[1:]))
        return stacked + noise * spread * jax.random.normal(k, stacked.shape, w.dtype)

    experts = Experts(*(copies(w, k) for w, k in
                        zip((ffn.w_gate, ffn.w_up, ffn.w_down), k_noise, strict=True)))
    layers = dataclasses.replace(dense.dense_layers,
                                 ffn=dataclasses.replace(fresh.moe_layers.ffn, experts=experts))
    return dataclasses.replace(fresh, embed=dense.embed, moe_layers=layers,
                               final_norm=dense.final_norm, lm_head=dense.lm_head)
