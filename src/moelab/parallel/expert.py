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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from moelab.config import ConfigError, MoEConfig
from moelab.model.dispatch import Dispatch, Experts
from moelab.model.dispatch.capacity import grouped_dispatch, in_groups, local_experts
from moelab.model.dispatch.dropless import Sorted, grouped_experts, sorted_dispatch
from moelab.model.moe import MoE
from moelab.model.router import Routing
from moelab.parallel.mesh import AXES, BATCH, EXPERT

AXIS = "expert"  # the mesh axis experts (and the exchange) are split over
Exchange = Literal["auto", "padded", "ragged"]


def expert_parallel(model: eqx.Module, mesh: Mesh, exchange: Exchange = "auto") -> eqx.Module:
    """`model` with every MoE layer's dispatch run expert-parallel over `mesh`.

    Weights are untouched (shard them with `moelab.parallel.mesh.place`); the batch given
    to the model must split evenly over mesh.data x mesh.expert devices.
    """
    if exchange == "auto":
        exchange = "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"
    if exchange not in ("padded", "ragged"):
        raise ValueError(f"exchange: {exchange!r} is not one of 'auto', 'padded', 'ragged'")
    dispatch = ExpertParallelDispatch(mesh, exchange)
    is_moe = lambda node: isinstance(node, MoE)
    for layer in jax.tree.leaves(model, is_leaf=is_moe):
        if is_moe(layer) and layer.moe.n_experts % mesh.shape[AXIS]:
            raise ConfigError(f"mesh.expert: {mesh.shape[AXIS]} must divide "
                              f"moe.n_experts={layer.moe.n_experts}")
    swap = lambda node: with_dispatch(node, dispatch) if is_moe(node) else node
    return jax.tree.map(swap, model, is_leaf=is_moe)


def with_dispatch(layer: MoE, dispatch: Dispatch) -> MoE:
    """A copy of `layer` with another dispatch.

    `dispatch` is a static field, which eqx.tree_at cannot reach, and MoE.__init__ draws
    fresh weights; so copy the fields onto a bare instance, as equinox's unflatten does.
    """
    new = object.__new__(MoE)
    for f in dataclasses.fields(layer):
        object.__setattr__(new, f.name, getattr(layer, f.name))
    object.__setattr__(new, "dispatch", dispatch)
    return new


@dataclass(frozen=True)
class ExpertParallelDispatch:
    """A `Dispatch` (x, routing, experts, moe) -> (y, dropped) run under shard_map.

    A frozen dataclass rather than a closure so that two models made the same way compare
    equal as static fields and share jit caches.
    """

    mesh: Mesh
    exchange: Literal["padded", "ragged"]

    def __call__(
        self, x: Float[Array, "B S D"], routing: Routing, experts: Experts, moe: MoEConfig
    ) -> tuple[Float[Array, "B S D"], Array]:
        devices = self.mesh.size
        if x.shape[0] % devices:
            raise ConfigError(f"data.batch_size: the (micro-)batch of {x.shape[0]} sequences "
                              f"must split evenly over the mesh's {devices} devices")
        body = partial(_local_dispatch, moe=moe, ep=self.mesh.shape[AXIS],
                       exchange=self.exchange)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(BATCH, BATCH, EXPERT),
                             out_specs=(BATCH, P()))(x, routing, experts)


def _local_dispatch(
    x: Float[Array, "b S D"],
    routing: Routing,
    experts: Experts,
    *,
    moe: MoEConfig,
    ep: int,
    exchange: str,
) -> tuple[Float[Array, "b S D"], Array]:
    """One device's part: its b sequences, its E / ep experts; the dropped count is global."""
    if moe.dispatch == "dropless":
        exchange_rows = _padded_rows if exchange == "padded" else _ragged_rows
        compute = partial(exchange_rows, experts=experts, moe=moe, ep=ep)
        y, dropped = sorted_dispatch(x, routing, compute, moe), jnp.zeros((), jnp.int32)
    else:
        per_group = 1 if moe.dispatch == "capacity" else moe.pool_size or x.shape[0]
        xg, rg = in_groups(x, routing, per_group)
        yg, dropped = grouped_dispatch(xg, rg, partial(_exchange_slots, experts=experts, ep=ep),
                                       moe)
        y = yg.reshape(x.shape)
    return y, jax.lax.psum(dropped, AXES)  # summed over every device


# ------------------------------------------------------------------ capacity / pooled


def _exchange_slots(
    slots: Float[Array, "G E C D"], *, experts: Experts, ep: int
) -> Float[Array, "G E C D"]:
    """Send each expert's slots to its device, compute there, bring the outputs back."""
    g, e, c, d = slots.shape
    e_loc = e // ep
    send = jnp.swapaxes(slots.reshape(g, ep, e_loc, c, d), 0, 1)  # [ep(dst), G, E_loc, C, D]
    recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True)  # [ep(src), G, E_loc, C, D]
    out = local_experts(experts)(recv.reshape(ep * g, e_loc, c, d))
    back = jax.lax.all_to_all(out.reshape(ep, g, e_loc, c, d), AXIS, 0, 0, tiled=True)
    return jnp.swapaxes(back, 0, 1).reshape(g, e, c, d)


# ------------------------------------------------------------------------- dropless


def _count_table(s: Sorted, ep: int) -> Int[Array, "src dst E_loc"]:
    """Rows every device of the expert group sends to every local expert of every device."""
    return jax.lax.all_gather(s.group_sizes, AXIS).reshape(ep, ep, -1)


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
    order = jnp.argsort(key, stable=True)
    s = Sorted(order=order, expert=key[order],
               group_sizes=jnp.bincount(key, length=e_loc).astype(jnp.int32))
    out_sorted = grouped_experts(rows[order], s, experts, moe)
    return jnp.zeros_like(rows).at[order].set(out_sorted)


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
    recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True)  # [ep(src), bound, D]
    received = table[:, jax.lax.axis_index(AXIS)]  # [ep(src), E_loc]
    out = _compute_received(recv.reshape(ep * bound, d), jnp.arange(ep) * bound, received,
                            experts, moe)
    back = jax.lax.all_to_all(out.reshape(ep, bound, d), AXIS, 0, 0, tiled=True)
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
    received = jnp.zeros((ep * _row_bound(n_rows, moe, ep), d), rows.dtype)
    received = jax.lax.ragged_all_to_all(rows, received, my_offsets, send_sizes, at_peer,
                                         recv_sizes, axis_name=AXIS)
    out = _compute_received(received, recv_start, table[:, me], experts, moe)
    return jax.lax.ragged_all_to_all(out, jnp.zeros_like(rows), recv_start, recv_sizes,
                                     back_at, send_sizes, axis_name=AXIS)
