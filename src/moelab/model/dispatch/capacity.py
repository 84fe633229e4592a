"""Capacity-factor dispatch (GShard / Switch): each expert has a fixed number of slots.

Tokens are split into groups (one sequence for `capacity`, `pool_size` sequences or the
whole batch for `pooled`). In each group an expert takes at most
    C = ceil(capacity_factor * group_tokens * top_k / n_experts)
assignments; first choices claim slots before second choices, earlier tokens before
later ones. Assignments past C are dropped: their expert output is zero and only the
residual carries the token on. Pooling makes groups bigger, so load evens out and fewer
assignments overflow.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moelab.config import MoEConfig, capacity
from moelab.model.dispatch.drops import Drops
from moelab.model.dispatch.experts import Experts
from moelab.model.router import Routing

ExpertCompute = Callable[[Float[Array, "G E C D"]], Float[Array, "G E C D"]]


def slot_in_expert(experts: Int[Array, "G N K"], n_experts: int) -> Int[Array, "G N K"]:
    """Each assignment's place in its expert's queue: choice rank first, then token order."""
    g, n, k = experts.shape
    by_priority = jnp.swapaxes(experts, 1, 2).reshape(g, k * n)  # all 1st choices, then 2nd...
    onehot = jax.nn.one_hot(by_priority, n_experts, dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    return jnp.swapaxes(slot.reshape(g, k, n), 1, 2)


def to_slots(
    x: Float[Array, "G N D"],
    experts: Int[Array, "G N K"],
    slot: Int[Array, "G N K"],
    cap: int,
    n_experts: int,
) -> Float[Array, "G E C D"]:
    """Copy each kept assignment's token into its expert's slot; overflow falls off."""
    g, n, k = experts.shape
    group = jnp.broadcast_to(jnp.arange(g)[:, None, None], experts.shape)
    token = jnp.broadcast_to(x[:, :, None, :], (g, n, k, x.shape[-1]))
    slots = jnp.zeros((g, n_experts, cap, x.shape[-1]), x.dtype)
    return slots.at[group, experts, slot].add(token, mode="drop")


def from_slots(
    y: Float[Array, "G E C D"], routing: Routing, slot: Int[Array, "G N K"], cap: int
) -> Float[Array, "G N D"]:
    """out[token] = sum over its kept assignments of weight * expert output."""
    g = y.shape[0]
    group = jnp.arange(g)[:, None, None]
    kept = slot < cap
    picked = y[group, routing.experts, jnp.minimum(slot, cap - 1)]  # [G, N, K, D]
    weights = jnp.where(kept, routing.weights, 0.0).astype(y.dtype)
    return jnp.einsum("gnk,gnkd->gnd", weights, picked)


def local_experts(experts: Experts) -> ExpertCompute:
    """Run all experts on their slots on this device."""

    def compute(slots: Float[Array, "G E C D"]) -> Float[Array, "G E C D"]:
        g, e, c, d = slots.shape
        rows = jnp.swapaxes(slots, 0, 1).reshape(e, g * c, d)
        return jnp.swapaxes(experts(rows).reshape(e, g, c, d), 0, 1)

    return compute


def grouped_dispatch(
    x: Float[Array, "G N D"], routing: Routing, compute: ExpertCompute, moe: MoEConfig
) -> tuple[Float[Array, "G N D"], Drops]:
    """Capacity dispatch within each group; returns outputs and the dropped count."""
    cap = capacity(x.shape[1], moe)
    slot = slot_in_expert(routing.experts, moe.n_experts)
    slots = to_slots(x, routing.experts, slot, cap, moe.n_experts)
    y = from_slots(compute(slots), routing, slot, cap)
    return y, Drops.at_expert(jnp.sum(slot >= cap))


def in_groups(x: Array, routing: Routing, sequences_per_group: int):
    """[B, S, ...] -> [B / n, n * S, ...]: n consecutive sequences share one capacity pool."""
    regroup = lambda a: a.reshape(a.shape[0] // sequences_per_group, -1, *a.shape[2:])
    return regroup(x), Routing(regroup(routing.experts), regroup(routing.weights))


def capacity_group(moe: MoEConfig, batch: int) -> int:
    """Sequences per capacity group of `capacity`: one."""
    return 1


def pooled_group(moe: MoEConfig, batch: int) -> int:
    """Sequences per capacity group of `pooled`: pool_size (0 = the whole (local) batch)."""
    return moe.pool_size or batch


def capacity_dispatch(
    x: Float[Array, "B S D"], routing: Routing, experts: Experts, moe: MoEConfig
) -> tuple[Float[Array, "B S D"], Drops]:
    """Capacity per sequence (GShard's default group)."""
    return grouped_dispatch(x, routing, local_experts(experts), moe)


def pooled_dispatch(
    x: Float[Array, "B S D"], routing: Routing, experts: Experts, moe: MoEConfig
) -> tuple[Float[Array, "B S D"], Drops]:
    """Capacity shared by `pool_size` sequences (0 = the whole batch)."""
    pool = pooled_group(moe, x.shape[0])
    xg, rg = in_groups(x, routing, pool)
    y, dropped = grouped_dispatch(xg, rg, local_experts(experts), moe)
    return y.reshape(x.shape), dropped
