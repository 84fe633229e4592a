"""Auxiliary-loss-free load balancing: a per-expert selection bias, updated between steps.

After every optimizer step, from the global batch's expert loads (the model's stats are
reduced over every data/expert shard, so every device computes the same new bias):

  bias_sign      bias_e += rate * sign(mean_load - load_e), then zero-meaned
                 (DeepSeek-V3; torchtitan, OLMo-core, MaxText)
  bias_quantile  bias += quantile_rate * (target - bias), target = the bias that would
                 have given every expert exactly its share of this batch (Marin's "QB";
                 see router.quantile_bias), zero-meaned; quantile_rate 1 is Marin's rule

The bias is a plain array field of each MoE layer (shape [..., E]: a leading layer axis
when layers are stacked), so it is checkpointed and restored with the weights; the
optimizer never sees it (`without_bias`), and the router stops its gradient.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from moelab.config import MoEConfig
from moelab.model.moe import MoE


def moe_layers(tree) -> list[MoE]:
    """The MoE layers of a model (or of a pytree shaped like one), in stats order."""
    is_moe = lambda node: isinstance(node, MoE)
    return [n for n in jax.tree.leaves(tree, is_leaf=is_moe) if is_moe(n)]


def _biased(tree) -> list[MoE]:
    return [layer for layer in moe_layers(tree) if layer.bias is not None]


def without_bias(tree):
    """`tree` with every selection bias replaced by None: what the optimizer updates."""
    layers = _biased(tree)
    if not layers:
        return tree
    return eqx.tree_at(lambda t: [layer.bias for layer in _biased(t)], tree,
                       [None] * len(layers))


def with_biases_of(source, tree):
    """`tree` with its selection biases taken from `source` (same structure)."""
    layers = _biased(source)
    if not layers:
        return tree
    return eqx.tree_at(lambda t: [layer.bias for layer in _biased(t)], tree,
                       [layer.bias for layer in layers])


def sign_rule(bias: Array, load: Array, rate: float) -> Array:
    """bias += rate * sign(mean_load - load), zero-meaned over experts (last axis)."""
    new = bias + rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)
    return new - jnp.mean(new, -1, keepdims=True)


def update_bias(model, parts: dict[str, Array], moe: MoEConfig, scale: Array | float = 1.0):
    """The model with each MoE layer's bias moved by `moe.balance`'s rule.

    `parts` holds the step's per-layer stats stacked in layer order ([L_moe, E]):
    `tokens_per_expert` and `quantile_bias` (see moelab.model.losses.objective). `scale`
    multiplies the rule's rate (`moe.bias_rate_schedule`; see train.optimizer).
    """
    layers = _biased(model)
    if moe.balance == "aux_loss" or not layers:
        return model
    new, start = [], 0
    for layer in layers:
        rows = math.prod(layer.bias.shape[:-1])
        name = "tokens_per_expert" if moe.balance == "bias_sign" else "quantile_bias"
        signal = parts[name][start:start + rows].reshape(layer.bias.shape)
        if moe.balance == "bias_sign":
            new.append(sign_rule(layer.bias, signal, scale * moe.bias_rate))
        else:
            new.append(layer.bias + scale * moe.quantile_rate * (signal - layer.bias))
        start += rows
    return eqx.tree_at(lambda m: [layer.bias for layer in _biased(m)], model, new)


def bias_range(model) -> Float[Array, " L"]:
    """max - min of each MoE layer's bias, for logging (empty without biases)."""
    ranges = [jnp.ptp(layer.bias, -1).reshape(-1) for layer in _biased(model)]
    return jnp.concatenate(ranges) if ranges else jnp.zeros((0,))
