"""Top-k routing of tokens to experts, and the two losses that keep routing healthy.

  scores  = softmax(x W_r)  or  sigmoid(x W_r)            [T, E]
  experts = top_k(scores + bias)      (bias: selection only, never weights nor gradient)
            with moe.n_group > 1, only among the experts of the topk_group groups whose
            two best (biased) scores sum highest (DeepSeek-V3's group-limited routing)
  weights = scores[experts] (renormalized to sum 1 if asked) * routed_scaling
  aux     = E * sum_e f_e * P_e        (Switch; f_e = share of assignments, P_e = mean prob)
  seq_aux = the same per sequence, averaged over sequences (DeepSeek-V3's complementary
            sequence-wise balance loss: f_e = E/(K*S) * tokens of the sequence sent to e)
  z       = mean_t logsumexp(x W_r)^2  (router z-loss; keeps router logits small)

`moe.uniform_routing` (a debug mode for measurements) replaces the choice by a fixed
perfectly balanced one: position s of every sequence goes to experts (s*K + j) mod E,
j < K, with weights 1/K. Scores, stats and the router weights stay, but the router gets
no gradient (its logits are stopped), so drop studies can separate imbalance from capacity.

The bias lives in score space, as transformers' Glm4Moe / DeepseekV3
`e_score_correction_bias` does, so a bias-balanced model exports exactly.
"""

from __future__ import annotations

import math

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
    seq_aux_loss: Float[Array, ""]  # the aux loss per sequence, averaged over sequences
    router_z: Float[Array, ""]
    tokens_per_expert: Float[Array, " E"]  # assignments received, before any capacity cut
    entropy: Float[Array, ""]  # mean over tokens of the entropy of the routing distribution
    quantile_bias: Float[Array, " E"]  # bias_quantile: the bias for the next step (else 0)


def route(
    logits: Float[Array, "B S E"], moe: MoEConfig, bias: Float[Array, " E"] | None = None
) -> tuple[Routing, RouterStats]:
    """Choose top_k experts per token from router logits (float32)."""
    logits = logits.astype(jnp.float32)
    if moe.uniform_routing:
        logits = jax.lax.stop_gradient(logits)
    scores = jax.nn.softmax(logits, -1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
    choice = scores
    if bias is not None:
        choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, experts = jax.lax.top_k(group_limited(choice, moe.n_group, moe.topk_group), moe.top_k)
    top_scores = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_top_k:
        top_scores = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
    if moe.routed_scaling != 1.0:
        top_scores = top_scores * moe.routed_scaling
    if moe.uniform_routing:
        experts, top_scores = uniform_choice(logits.shape[:2], moe.top_k, moe.n_experts)
    seq_counts = jnp.sum(jax.nn.one_hot(experts, moe.n_experts), axis=(1, 2))  # [B, E]
    counts = jnp.sum(seq_counts, axis=0)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # sigmoid scores -> a distribution
    stats = RouterStats(
        aux_loss=load_balancing_loss(counts, probs),
        seq_aux_loss=jnp.mean(jax.vmap(load_balancing_loss)(seq_counts, probs)),
        router_z=jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        tokens_per_expert=counts,
        entropy=jax.lax.stop_gradient(-jnp.mean(jnp.sum(probs * jnp.log(probs + 1e-30), -1))),
        quantile_bias=(quantile_bias(choice, bias, moe.top_k) if moe.balance == "bias_quantile"
                       else jnp.zeros(moe.n_experts)),
    )
    return Routing(experts, top_scores), stats


def group_limited(choice: Float[Array, "B S E"], n_group: int, topk_group: int
                  ) -> Float[Array, "B S E"]:
    """`choice` with -inf for every expert outside the token's topk_group best groups, a
    group scoring the sum of its two best choice scores (DeepSeek-V3, transformers'
    Glm4MoeTopkRouter). n_group 1 leaves every expert eligible."""
    if n_group == 1:
        return choice
    grouped = choice.reshape(*choice.shape[:-1], n_group, -1)  # [B, S, G, E/G]
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], -1)  # [B, S, G]
    kept = jax.lax.top_k(group_score, topk_group)[1]
    eligible = jnp.any(jax.nn.one_hot(kept, n_group) > 0, axis=-2)  # [B, S, G]
    return jnp.where(eligible[..., None], grouped, -jnp.inf).reshape(choice.shape)


def uniform_choice(
    shape: tuple[int, int], top_k: int, n_experts: int
) -> tuple[Int[Array, "B S K"], Float[Array, "B S K"]]:
    """Experts (s*K + j) mod E for position s, weights 1/K: every expert gets exactly its
    share of each sequence whenever S*K is a multiple of E (`moe.uniform_routing`)."""
    b, s = shape
    experts = (jnp.arange(s)[:, None] * top_k + jnp.arange(top_k)) % n_experts
    experts = jnp.broadcast_to(experts, (b, s, top_k)).astype(jnp.int32)
    return experts, jnp.full((b, s, top_k), 1.0 / top_k, jnp.float32)


def load_balancing_loss(counts: Float[Array, " E"], probs: Float[Array, "... E"]) -> Array:
    """Switch Transformer aux loss; equals 1.0 when routing is perfectly uniform.

    Given one sequence's counts and scores it is DeepSeek-V3's sequence-wise term:
    E * counts_e / sum(counts) = E / (K * S) * counts_e."""
    n_experts = counts.shape[0]
    assignment_share = counts / jnp.sum(counts)
    mean_prob = jnp.mean(probs.reshape(-1, n_experts), axis=0)
    return n_experts * jnp.sum(assignment_share * mean_prob)


def quantile_bias(
    choice: Float[Array, "B S E"], bias: Float[Array, " E"], top_k: int
) -> Float[Array, " E"]:
    """Marin's "QB" rule: the bias that would give every expert its share of this batch.

    The new bias is bias - share_margin(...), zero-meaned (only differences between
    experts change a top-k).
    """
    new = bias.astype(jnp.float32) - share_margin(choice, top_k)
    return new - jnp.mean(new)


def share_margin(choice: Float[Array, "B S E"], top_k: int) -> Float[Array, " E"]:
    """beta_e: how far expert e's fair share of tokens sits above the selection line.

    A token picks expert e when e's biased score beats the k-th best of the *other*
    experts' (the token's (k+1)-th choice if e is picked, its k-th if not); call the
    difference e's margin on that token. With C = ceil(T * k / E) the expert's fair share,
    beta_e is its C-th largest margin over the batch: moving e's bias by -beta_e, the
    others held, leaves exactly C tokens with a positive margin.
    """
    n_experts = choice.shape[-1]
    flat = jax.lax.stop_gradient(choice.reshape(-1, n_experts))
    top = jax.lax.top_k(flat, top_k + 1)[0]
    kth, next_ = top[:, top_k - 1:top_k], top[:, top_k:]
    margin = flat - jnp.where(flat >= kth, next_, kth)
    share = math.ceil(flat.shape[0] * top_k / n_experts)
    return jax.lax.top_k(margin.T, share)[0][:, -1]
