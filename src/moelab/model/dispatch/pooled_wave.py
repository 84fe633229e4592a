"""Pooled-wave dispatch (Marin/Levanter's fixed pooled-wave all-to-all), as a drop rule.

The batch is split into `shards` senders (the devices of an expert group; one shard on a
single device) and the experts into `shards` receivers. Each sender ranks its own
assignments, first choices before second choices, earlier tokens before later ones, and
  1. ships at most S = ceil(send_capacity_factor * T * k / shards) rows to each receiver
     (T = its tokens): the rest are *sender drops*; unused rows of that block are padding;
  2. an expert keeps at most C = ceil(capacity_factor * shards * T * k / E) rows, pooled
     over every sender and filled round-robin: each sender's first row for the expert,
     then each sender's second, ... (starting at sender e mod shards, so no sender is
     always cut first); rows past C are *receiver drops*.
The rule depends only on the routing and the count table, so every sender computes the
place of its rows itself and a single device reproduces an exchange over `shards`
devices exactly (moelab.parallel.expert runs the same plan with all_to_all in waves).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moelab.config import MoEConfig
from moelab.model.dispatch.capacity import slot_in_expert
from moelab.model.dispatch.drops import Drops
from moelab.model.dispatch.experts import Experts
from moelab.model.router import Routing


def wave_capacities(tokens: int, moe: MoEConfig, shards: int) -> tuple[int, int]:
    """(rows a sender ships to each receiver, rows each expert keeps) for T local tokens."""
    send = math.ceil(moe.send_capacity_factor * tokens * moe.top_k / shards)
    keep = math.ceil(moe.capacity_factor * shards * tokens * moe.top_k / moe.n_experts)
    return max(send, 1), max(keep, 1)


class SendPlan(eqx.Module):
    """One sender's assignments [T, K]: where each goes and whether it is shipped."""

    dst: Int[Array, "T K"]  # receiving shard
    pos: Int[Array, "T K"]  # row in the block shipped to dst
    sent: Bool[Array, "T K"]
    index: Int[Array, "T K"]  # place among this sender's rows for the same expert
    counts: Int[Array, " E"]  # rows shipped per expert


def send_plan(experts: Int[Array, "T K"], n_experts: int, shards: int, send_cap: int
              ) -> SendPlan:
    dst = experts // (n_experts // shards)
    pos = slot_in_expert(dst[None], shards)[0]  # priority order within each receiver
    sent = pos < send_cap
    # A receiver's block is a prefix in priority order, so an expert's shipped rows are a
    # prefix of its rows too: their index is their slot among all of them.
    index = slot_in_expert(experts[None], n_experts)[0]
    counts = jnp.zeros(n_experts, jnp.int32).at[experts].add(sent.astype(jnp.int32))
    return SendPlan(dst=dst, pos=pos, sent=sent, index=index, counts=counts)


def pooled_rank(plan: SendPlan, experts: Int[Array, "T K"], source: Array,
                table: Int[Array, "shards E"]) -> Int[Array, "T K"]:
    """Each shipped row's place in its expert's round-robin queue over all senders.

    Rows come in rounds (index 0 of every sender, then index 1, ...), senders within a
    round in the order e, e+1, ... (mod shards). Before row (index i, sender s) stand
    min(n_{s'}, i + [s' precedes s in the round]) rows of every sender s'.
    """
    shards = table.shape[0]
    per_sender = table[:, experts]  # [shards, T, K]: rows each sender ships to my expert
    turn = lambda s: (s - experts) % shards
    precedes = turn(jnp.arange(shards)[:, None, None]) < turn(source)
    return jnp.sum(jnp.minimum(per_sender, plan.index + precedes), axis=0)


def wave_drops(sent: Array, kept: Array, buffer_rows: int) -> Drops:
    """Drop counts from the shipped and kept masks; `buffer_rows`: all send blocks' rows."""
    n_sent = jnp.sum(sent, dtype=jnp.int32)
    return Drops(sender=jnp.sum(~sent, dtype=jnp.int32),
                 receiver=n_sent - jnp.sum(kept, dtype=jnp.int32),
                 padding=buffer_rows - n_sent)


def wave_plan(experts: Int[Array, "shards T K"], moe: MoEConfig
              ) -> tuple[SendPlan, Int[Array, "shards T K"], Bool[Array, "shards T K"]]:
    """Every sender's plan, each row's round-robin place, and which rows are kept."""
    shards = experts.shape[0]
    send_cap, keep_cap = wave_capacities(experts.shape[1], moe, shards)
    plans = jax.vmap(send_plan, in_axes=(0, None, None, None))(experts, moe.n_experts, shards,
                                                                send_cap)
    rank = jax.vmap(pooled_rank, in_axes=(0, 0, 0, None))(plans, experts, jnp.arange(shards),
                                                          plans.counts)
    return plans, rank, plans.sent & (rank < keep_cap)


def pooled_wave_dispatch(
    x: Float[Array, "B S D"], routing: Routing, experts: Experts, moe: MoEConfig,
    shards: int = 1,
) -> tuple[Float[Array, "B S D"], Drops]:
    """The pooled-wave rule over `shards` senders of B / shards sequences each, on one device.

    Kept rows fill expert slots [E, C, D] at (expert, round-robin place); the
    expert-parallel exchange builds the same slots on the receiving devices.
    """
    b, s_len, d = x.shape
    k = routing.experts.shape[-1]
    split = lambda a: a.reshape(shards, -1, k)
    xs, es, ws = x.reshape(shards, -1, d), split(routing.experts), split(routing.weights)
    plans, rank, kept = wave_plan(es, moe)
    send_cap, keep_cap = wave_capacities(es.shape[1], moe, shards)
    slot = jnp.where(kept, rank, keep_cap)  # out of range: dropped by the scatter
    rows = jnp.broadcast_to(xs[:, :, None, :], (*es.shape, d))
    slots = jnp.zeros((moe.n_experts, keep_cap, d), x.dtype).at[es, slot].add(rows, mode="drop")
    out = experts(slots)[es, jnp.minimum(slot, keep_cap - 1)]  # [shards, T, K, D]
    weights = jnp.where(kept, ws, 0.0).astype(x.dtype)
    y = jnp.einsum("stk,stkd->std", weights, out).reshape(b, s_len, d)
    return y, wave_drops(plans.sent, kept, shards * shards * send_cap)
