"""Top-k routing of tokens to experts, and the two losses that keep routing healthy.

  scores  = softmax(x W_r)  or  sigmoid(x W_r)            [T, E]
  experts = top_k(scores);  weights = scores[experts] (renormalized to sum 1 if asked)
  aux     = E * sum_e f_e * P_e        (Switch; f_e = share of assignments, P_e = mean prob)
  z       = mean_t logsumexp(x W_r)^2  (router z-loss; keeps router logits small)
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moelab.config import MoEConfig


class Routing(eqx.Module):
    """Which experts each token goes to, with what weight: the input to every dispatch."""

    experts: Int[Array, "B S K"]
    weights: Float[Array, "B S K"]


class RouterStats(eqx.Module):
    aux_loss: Float[Array, ""]
    router_z: Float[Array, ""]
    tokens_per_expert: Float[Array, " E"]  # assignments received, before any capacity cut


def route(
    logits: Float[Array, "B S E"], moe: MoEConfig
) -> tuple[Routing, RouterStats]:
    """Choose top_k experts per token from router logits (float32)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, -1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
    top_scores, experts = jax.lax.top_k(scores, moe.top_k)
    if moe.normalize_top_k:
        top_scores = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
    counts = jnp.sum(jax.nn.one_hot(experts, moe.n_experts), axis=(0, 1, 2))
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # sigmoid scores -> a distribution
    stats = RouterStats(
        aux_loss=load_balancing_loss(counts, probs),
        router_z=jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        tokens_per_expert=counts,
    )
    return Routing(experts, top_scores), stats


def load_balancing_loss(counts: Float[Array, " E"], probs: Float[Array, "B S E"]) -> Array:
    """Switch Transformer aux loss; equals 1.0 when routing is perfectly uniform."""
    n_experts = counts.shape[0]
    assignment_share = counts / jnp.sum(counts)
    mean_prob = jnp.mean(probs.reshape(-1, n_experts), axis=0)
    return n_experts * jnp.sum(assignment_share * mean_prob)
