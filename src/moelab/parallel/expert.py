"""Expert parallelism: each device holds E / ep experts; tokens travel to them and back.

`expert_parallel(model, mesh)` swaps every MoE layer's `dispatch` for one run under
`jax.shard_map` over the ("data", "expert") mesh:

    x, routing  [B, S, ...]  sharded P(("data", "expert"))  each device: its own sequences
    experts     [E, ...]     sharded P("expert")            each device: E / ep experts

Inside, a device routes its local tokens exactly as the single-device dispatch would,
exchanges them over the `expert` axis with `all_to_all`, runs its local experts on what
it received from every peer, and sends the outputs back. Devices that differ only in
their `data` coordinate hold the same experts and never talk to each other here.

Capacity groups are local. `capacity` groups one sequence, so it equals the single-device
path exactly. `pooled` pools `pool_size` sequences of the local batch (0 = the whole
*local* batch); it equals the single-device path only when pool_size divides the local
batch (config validation requires that) and is not 0, since a global pool cannot be
formed without gathering every token.

Dropless exchange (`exchange`): a device sends each expert-device a variable number of
rows, which a dense `all_to_all` cannot express. Two ways, same numbers:
  * "padded" (CPU and anywhere): send each peer a block padded to the static bound
    T * min(top_k, E / ep) rows (a token meets at most min(top_k, E/ep) distinct experts
    on one device, so no row is ever dropped), with the exact per-expert counts
    all-gathered beside it; the receiver masks padding (it rides as zero rows of the last
    local expert, whose outputs are never read) and sorts rows by local expert for the
    grouped kernel. Costs ep x the wire volume of the rows actually sent, in the worst case.
  * "ragged" (GPU/TPU): `jax.lax.ragged_all_to_all` sends exactly the rows, at offsets
    computed from the same count table. XLA:CPU does not implement it, so on CPU it is
    exercised only against an all_gather emulation in the tests.
"auto" picks ragged on GPU/TPU and padded elsewhere.

Ring exchange (`exchange="ring"`, Marin's default): all-gather the expert group's tokens
and routing, let each device run its local experts on every gathered assignment meant for
them (capacity slots or sorted rows, computed exactly as on one device), and psum-scatter
the partial outputs back to their owners. Any dispatch but pooled_wave; no row bound,
ep x the activations in memory.

Pooled wave (`moe.dispatch: pooled_wave`): see moelab.model.dispatch.pooled_wave for the
rule. Each device plans its own rows from the all-gathered table of rows shipped per
expert, sends fixed blocks of S rows per peer with their slot number beside them, in
`moe.waves` all_to_all rounds; receivers scatter them into expert slots, compute, and
return the outputs the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from moelab.config import ConfigError, MoEConfig
from moelab.model.dispatch import (
    CAPACITY,
    DROPLESS,
    POOLED,
    POOLED_WAVE,
    Dispatch,
    Drops,
    Experts,
    entry_of,
)
from moelab.model.dispatch.capacity import (
    capacity_group,
    grouped_dispatch,
    in_groups,
    local_experts,
    pooled_group,
)
from moelab.model.dispatch.dropless import (
    Sorted,
    grouped_experts,
    in_expert_order,
    sorted_dispatch,
)
from moelab.model.dispatch.pooled_wave import (
    pooled_rank,
    send_plan,
    wave_capacities,
    wave_drops,
)
from moelab.model.moe import EXCHANGE_IN, EXCHANGE_OUT, MoE
from moelab.model.router import Routing
from moelab.parallel.mesh import AXES, BATCH, EXPERT

AXIS = "expert"  # the mesh axis experts (and the exchange) are split over
Exchange = Literal["auto", "padded", "ragged", "ring"]


def expert_parallel(model: eqx.Module, mesh: Mesh, exchange: Exchange = "auto") -> eqx.Module:
    """`model` with every MoE layer's dispatch run expert-parallel over `mesh`.

    Weights are untouched (shard them with `moelab.parallel.mesh.place`); the batch given
    to the model must split evenly over mesh.data x mesh.expert devices.
    """
    if exchange == "auto":
        exchange = "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"
    if exchange not in ("padded", "ragged", "ring"):
        raise ValueError(f"exchange: {exchange!r} is not one of 'auto', 'padded', 'ragged', "
                         "'ring'")
    dispatch = ExpertParallelDispatch(mesh, exchange)
    is_moe = lambda node: isinstance(node, MoE)
    for layer in jax.tree.leaves(model, is_leaf=is_moe):
        if is_moe(layer) and layer.moe.n_experts % mesh.shape[AXIS]:
            raise ConfigError(f"mesh.expert: {mesh.shape[AXIS]} must divide "
                              f"moe.n_experts={layer.moe.n_experts}")
        if is_moe(layer) and entry_of(layer.moe).expert_parallel is None:
            raise ConfigError(f"mesh.expert: moe.dispatch={layer.moe.dispatch} has no "
                              "expert-parallel form; set mesh.expert: 1")
    swap = lambda node: with_dispatch(node, dispatch) if is_moe(node) else node
    return jax.tree.map(swap, model, is_leaf=is_moe)


def with_dispatch(layer: MoE, dispatch: Dispatch) -> MoE:
    """A copy of `layer` with another dispatch (a static field, so not eqx.tree_at)."""
    return dataclasses.replace(layer, dispatch=dispatch)


@dataclass(frozen=True)
class ExpertParallelDispatch:
    """A `Dispatch` (x, routing, experts, moe) -> (y, dropped) run under shard_map.

    A frozen dataclass rather than a closure so that two models made the same way compare
    equal as static fields and share jit caches.
    """

    mesh: Mesh
    exchange: Literal["padded", "ragged", "ring"]

    def __call__(
        self, x: Float[Array, "B S D"], routing: Routing, experts: Experts, moe: MoEConfig
    ) -> tuple[Float[Array, "B S D"], Drops]:
        devices = self.mesh.size
        if x.shape[0] % devices:
            raise ConfigError(f"data.batch_size: the (micro-)batch of {x.shape[0]} sequences "
                              f"must split evenly over the mesh's {devices} devices")
        body = partial(_local_dispatch, moe=moe, ep=self.mesh.shape[AXIS],
                       exchange=self.exchange)
        # check_vma off: the CPU grouped kernel's loops carry buffers made in place, which
        # the varying-axes type check would reject (the drop counts are psum'd explicitly)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(BATCH, BATCH, EXPERT),
                             out_specs=(BATCH, P()), check_vma=False)(x, routing, experts)


def received(a: Array) -> Array:
    """What an exchange brought to this device: kept by `model.remat: save_moe`, so the
    backward pass does not run the exchange again to recompute it."""
    return checkpoint_name(a, EXCHANGE_IN)


def returned(a: Array) -> Array:
    """What came back from the experts' devices (kept by save_moe likewise)."""
    return checkpoint_name(a, EXCHANGE_OUT)


def _psum(drops: Drops, axes) -> Drops:
    return jax.tree.map(lambda a: jax.lax.psum(a, axes), drops)


def _local_dispatch(
    x: Float[Array, "b S D"],
    routing: Routing,
    experts: Experts,
    *,
    moe: MoEConfig,
    ep: int,
    exchange: str,
) -> tuple[Float[Array, "b S D"], Drops]:
    """One device's part: its b sequences, its E / ep experts; the drop counts are global."""
    return entry_of(moe).expert_parallel(x, routing, experts, moe=moe, ep=ep, exchange=exchange)


def _grouped(
    x: Float[Array, "b S D"], routing: Routing, experts: Experts, *, moe: MoEConfig, ep: int,
    exchange: str, group: Callable[[MoEConfig, int], int],
) -> tuple[Float[Array, "b S D"], Drops]:
    """capacity / pooled: capacity groups of `group(moe, b)` local sequences."""
    per_group = group(moe, x.shape[0])
    if exchange == "ring":
        return _ring(x, routing, experts, moe=moe, ep=ep, per_group=per_group)
    xg, rg = in_groups(x, routing, per_group)
    yg, dropped = grouped_dispatch(xg, rg, partial(_exchange_slots, experts=experts, ep=ep), moe)
    return yg.reshape(x.shape), _psum(dropped, AXES)  # summed over every device


def _sorted(
    x: Float[Array, "b S D"], routing: Routing, experts: Experts, *, moe: MoEConfig, ep: int,
    exchange: str,
) -> tuple[Float[Array, "b S D"], Drops]:
    """dropless: rows sorted by expert, exchanged padded, ragged or by the ring."""
    if exchange == "ring":
        return _ring(x, routing, experts, moe=moe, ep=ep, per_group=None)
    exchange_rows = _padded_rows if exchange == "padded" else _ragged_rows
    compute = partial(exchange_rows, experts=experts, moe=moe, ep=ep)
    return sorted_dispatch(x, routing, compute, moe), _psum(Drops.at_expert(0), AXES)


# ------------------------------------------------------------------ capacity / pooled


def _exchange_slots(
    slots: Float[Array, "G E C D"], *, experts: Experts, ep: int
) -> Float[Array, "G E C D"]:
    """Send each expert's slots to its device, compute there, bring the outputs back."""
    g, e, c, d = slots.shape
    e_loc = e // ep
    send = jnp.swapaxes(slots.reshape(g, ep, e_loc, c, d), 0, 1)  # [ep(dst), G, E_loc, C, D]
    recv = received(jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True))  # [ep(src), G, E_loc, C, D]
    out = local_experts(experts)(recv.reshape(ep * g, e_loc, c, d))
    back = returned(jax.lax.all_to_all(out.reshape(ep, g, e_loc, c, d), AXIS, 0, 0, tiled=True))
    return jnp.swapaxes(back, 0, 1).reshape(g, e, c, d)


# ------------------------------------------------------------------------- dropless


def _count_table(s: Sorted, ep: int) -> Int[Array, "src dst E_loc"]:
    """Rows every device of the expert group sends to every local expert of every device."""
    return received(jax.lax.all_gather(s.group_sizes, AXIS)).reshape(ep, ep, -1)


def _row_bound(n_rows: int, moe: MoEConfig, ep: int) -> int:
    """Most rows one device can send to another: top-k experts are distinct per token."""
    return n_rows // moe.top_k * min(moe.top_k, moe.n_experts // ep)


def _exclusive_cumsum(a: Array, axis: int = 0) -> Array:
    return jnp.cumsum(a, axis=axis) - a


def _compute_received(
    rows: Float[Array, "R D"],
    run_start: Int[Array, " ep"],
    counts: Int[Array, "ep E_loc"],
    experts: Experts,
    moe: MoEConfig,
) -> Float[Array, "R D"]:
    """Local experts on received rows: one run per source, each sorted by local expert.

    Rows past a run's count are padding; they join the last local expert as rows whose
    outputs nobody reads (so they add nothing to outputs or gradients).
    """
    e_loc = counts.shape[1]
    r = jnp.arange(rows.shape[0])
    src = jnp.searchsorted(run_start, r, side="right") - 1
    offset = r - run_start[src]
    local_expert = jnp.sum(offset[:, None] >= jnp.cumsum(counts, axis=1)[src], axis=1)
    key = jnp.minimum(local_expert, e_loc - 1)
    compute = lambda sorted_rows, s: grouped_experts(sorted_rows, s, experts, moe)
    return in_expert_order(rows, key, e_loc, compute)


def _padded_rows(
    rows: Float[Array, "A D"], s: Sorted, *, experts: Experts, moe: MoEConfig, ep: int
) -> Float[Array, "A D"]:
    """Dense all_to_all of per-peer blocks padded to a static bound; counts travel beside."""
    n_rows, d = rows.shape
    e_loc, bound = moe.n_experts // ep, _row_bound(n_rows, moe, ep)
    table = _count_table(s, ep)
    dst = s.expert // e_loc  # rows are sorted by expert, so by destination too
    pos = jnp.arange(n_rows) - _exclusive_cumsum(s.group_sizes.reshape(ep, e_loc).sum(1))[dst]
    send = jnp.zeros((ep, bound, d), rows.dtype).at[dst, pos].set(rows)
    recv = received(jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True))  # [ep(src), bound, D]
    counts = table[:, jax.lax.axis_index(AXIS)]  # [ep(src), E_loc]
    out = _compute_received(recv.reshape(ep * bound, d), jnp.arange(ep) * bound, counts,
                            experts, moe)
    back = returned(jax.lax.all_to_all(out.reshape(ep, bound, d), AXIS, 0, 0, tiled=True))
    return back[dst, pos]


def _ragged_rows(
    rows: Float[Array, "A D"], s: Sorted, *, experts: Experts, moe: MoEConfig, ep: int
) -> Float[Array, "A D"]:
    """ragged_all_to_all of exactly the rows each peer needs (GPU/TPU only)."""
    n_rows, d = rows.shape
    me = jax.lax.axis_index(AXIS)
    table = _count_table(s, ep)
    per_device = table.sum(-1)  # [src, dst]
    send_sizes, recv_sizes = per_device[me], per_device[:, me]
    my_offsets = _exclusive_cumsum(send_sizes)  # where each peer's rows start in `rows`
    recv_start = _exclusive_cumsum(recv_sizes)  # where each peer's rows land here
    at_peer = _exclusive_cumsum(per_device, axis=0)[me]  # where mine land on each peer
    back_at = _exclusive_cumsum(per_device, axis=1)[:, me]  # where peers' rows sat at home
    empty = jnp.zeros((ep * _row_bound(n_rows, moe, ep), d), rows.dtype)
    received_rows = received(jax.lax.ragged_all_to_all(rows, empty, my_offsets, send_sizes,
                                                       at_peer, recv_sizes, axis_name=AXIS))
    out = _compute_received(received_rows, recv_start, table[:, me], experts, moe)
    return returned(jax.lax.ragged_all_to_all(out, jnp.zeros_like(rows), recv_start,
                                              recv_sizes, back_at, send_sizes, axis_name=AXIS))


# ----------------------------------------------------------------------------- ring


def _ring(
    x: Float[Array, "b S D"], routing: Routing, experts: Experts, *, moe: MoEConfig, ep: int,
    per_group: int | None,
) -> tuple[Float[Array, "b S D"], Drops]:
    """All-gather the group's tokens, run local experts on their share, psum-scatter back.

    Capacity groups (`per_group` sequences; None: dropless, sorted rows) are the same as
    under all_to_all (pool_size 0 = one device's batch), so every device of the group
    counts the same drops: the count is summed over data only.
    """
    gather = lambda a: received(jax.lax.all_gather(a, AXIS, axis=0, tiled=True))
    xs, rs = gather(x), jax.tree.map(gather, routing)
    first = jax.lax.axis_index(AXIS) * (moe.n_experts // ep)  # my first expert
    if per_group is None:
        compute = partial(_local_rows, experts=experts, moe=moe, first=first)
        y, dropped = sorted_dispatch(xs, rs, compute, moe), Drops.at_expert(0)
    else:
        xg, rg = in_groups(xs, rs, per_group)
        compute = partial(_local_slots, experts=experts, first=first)
        yg, dropped = grouped_dispatch(xg, rg, compute, moe)
        y = yg.reshape(xs.shape)
    y = jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)
    # equal on every device of the group: pmax only marks the count replicated over it
    return y, jax.tree.map(lambda a: jax.lax.pmax(a, AXIS), _psum(dropped, ("data", "fsdp")))


def _local_slots(
    slots: Float[Array, "G E C D"], *, experts: Experts, first: Array
) -> Float[Array, "G E C D"]:
    """My experts' slots computed; every other expert's output left zero."""
    e_loc = experts.n_experts
    mine = jax.lax.dynamic_slice_in_dim(slots, first, e_loc, axis=1)
    out = local_experts(experts)(mine)
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(slots), out, first, axis=1)


def _local_rows(
    rows: Float[Array, "A D"], s: Sorted, *, experts: Experts, moe: MoEConfig, first: Array
) -> Float[Array, "A D"]:
    """Rows sorted by expert; mine computed, the others zero.

    Rows of experts before (after) mine ride with my first (last) expert, which keeps the
    order sorted for the grouped kernel; their outputs are masked to zero.
    """
    e_loc = experts.n_experts
    local = s.expert - first
    mine = (local >= 0) & (local < e_loc)
    key = jnp.clip(local, 0, e_loc - 1)
    sizes = jnp.bincount(key, length=e_loc).astype(jnp.int32)
    out = grouped_experts(rows, Sorted(order=s.order, expert=key, group_sizes=sizes), experts,
                          moe)
    return jnp.where(mine[:, None], out, 0.0)


# ---------------------------------------------------------------------- pooled wave


def _pooled_wave(
    x: Float[Array, "b S D"], routing: Routing, experts: Experts, *, moe: MoEConfig, ep: int,
    exchange: str,
) -> tuple[Float[Array, "b S D"], Drops]:
    """The pooled-wave rule of moelab.model.dispatch.pooled_wave over the expert group (its
    own all_to_all in waves, whatever `exchange`: the registry's check refuses ring)."""
    b, s_len, d = x.shape
    k, e_loc = moe.top_k, moe.n_experts // ep
    es, ws = routing.experts.reshape(-1, k), routing.weights.reshape(-1, k)
    send_cap, keep_cap = wave_capacities(es.shape[0], moe, ep)
    plan = send_plan(es, moe.n_experts, ep, send_cap)
    table = received(jax.lax.all_gather(plan.counts, AXIS))  # [ep(src), E]: rows per expert
    rank = pooled_rank(plan, es, jax.lax.axis_index(AXIS), table)
    kept = plan.sent & (rank < keep_cap)
    n_slots = e_loc * keep_cap  # a receiver's slots; index n_slots marks "drop"
    slot = jnp.where(kept, (es % e_loc) * keep_cap + rank, n_slots)
    wave = -(-send_cap // moe.waves)
    pos = jnp.where(plan.sent, plan.pos, wave * moe.waves)  # unsent: off the buffer
    rows = jnp.broadcast_to(x.reshape(-1, 1, d), (*es.shape, d))
    send = jnp.zeros((ep, wave * moe.waves, d), x.dtype).at[plan.dst, pos].set(rows, mode="drop")
    meta = jnp.full((ep, wave * moe.waves), n_slots).at[plan.dst, pos].set(slot, mode="drop")
    swap = lambda a: jax.lax.all_to_all(a, AXIS, 0, 0, tiled=True)
    chunks = [slice(w * wave, (w + 1) * wave) for w in range(moe.waves)]
    slots, metas = jnp.zeros((n_slots, d), x.dtype), []
    for chunk in chunks:  # ship in waves: only one wave's rows are in flight at a time
        got, where = received(swap(send[:, chunk])), received(swap(meta[:, chunk]))
        slots = slots.at[where.reshape(-1)].add(got.reshape(-1, d), mode="drop")
        metas.append(where)
    out = experts(slots.reshape(e_loc, keep_cap, d)).reshape(n_slots, d)
    back = jnp.concatenate(
        [returned(swap(out.at[where].get(mode="fill", fill_value=0))) for where in metas], axis=1)
    picked = back.at[plan.dst, pos].get(mode="fill", fill_value=0)  # [T, K, D]
    y = jnp.einsum("tk,tkd->td", jnp.where(kept, ws, 0.0).astype(x.dtype), picked)
    return y.reshape(b, s_len, d), _psum(wave_drops(plan.sent, kept, ep * send_cap), AXES)


# The built-in dispatches' expert-parallel forms, filled into the registry's entries.
CAPACITY.expert_parallel = partial(_grouped, group=capacity_group)
POOLED.expert_parallel = partial(_grouped, group=pooled_group)
POOLED_WAVE.expert_parallel = _pooled_wave
DROPLESS.expert_parallel = _sorted
