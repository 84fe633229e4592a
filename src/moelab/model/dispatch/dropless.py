"""Dropless dispatch: sort assignments by expert and run grouped matmuls; nothing is dropped.

Two kernels compute the same numbers:
  * `ragged`: `jax.lax.ragged_dot`, a true grouped GEMM on GPU/TPU. On XLA:CPU it lowers
    to a dense masked product over every expert (measured: 58 ms vs 8 ms for the
    capacity-shaped einsum at 4096 tokens, 8 experts, 256->512), so CPU does not use it.
  * `blocked`: `moelab.model.dispatch.grouped.grouped_swiglu`, each expert's run of sorted
    rows in chunks of 8 * `block_size` rows, then the tail in one chunk per binary digit
    of its length in blocks, as plain 2-D matmuls in loops with data-dependent trip
    counts.
  * `slab`: `moelab.model.dispatch.grouped.slab_swiglu`, every expert's first
    ceil(rows / experts) rows (rounded up to 8) as one batched matmul of static shape and
    the rows past that through the blocked loop: faster than `blocked` where the experts
    are narrow and their matmuls small (measured in bench/moe_layer.py).
`auto` picks ragged on GPU/TPU and blocked on CPU. Rows move by permutations whose
backward pass is the inverse permutation (a gather), never a scatter-add.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moelab.config import MoEConfig
from moelab.model.dispatch.drops import Drops
from moelab.model.dispatch.experts import Experts
from moelab.model.dispatch.grouped import (
    grouped_swiglu,
    inverse_permutation,
    permute_rows,
    slab_swiglu,
)
from moelab.model.router import Routing


class Sorted(eqx.Module):
    """Assignments sorted by expert: row i of the sorted order is assignment order[i]."""

    order: Int[Array, " A"]  # assignment index (token * K + choice) at each sorted position
    expert: Int[Array, " A"]  # expert of each sorted row (non-decreasing)
    group_sizes: Int[Array, " E"]  # rows per expert


def sort_by_expert(experts: Int[Array, "*shape"], n_experts: int) -> Sorted:
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return Sorted(order=order, expert=flat[order], group_sizes=sizes)


def ragged_experts(rows: Float[Array, "A D"], s: Sorted, experts: Experts) -> Array:
    """Grouped SwiGLU with jax.lax.ragged_dot (rows sorted by expert)."""
    gate = jax.lax.ragged_dot(rows, experts.w_gate, s.group_sizes)
    up = jax.lax.ragged_dot(rows, experts.w_up, s.group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts.w_down, s.group_sizes)


def use_ragged(moe: MoEConfig) -> bool:
    if moe.dropless_impl == "auto":
        return jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
    return moe.dropless_impl == "ragged"


@jax.named_scope("experts")
def grouped_experts(rows: Array, s: Sorted, experts: Experts, moe: MoEConfig) -> Array:
    if use_ragged(moe):
        return ragged_experts(rows, s, experts)
    kernel = slab_swiglu if moe.dropless_impl == "slab" else grouped_swiglu
    return kernel(rows, s.group_sizes, experts.w_gate, experts.w_up, experts.w_down,
                  moe.block_size)


SortedCompute = Callable[[Float[Array, "A D"], Sorted], Float[Array, "A D"]]


def in_expert_order(
    rows: Float[Array, "A D"], expert: Int[Array, " A"], n_experts: int, compute: SortedCompute
) -> Float[Array, "A D"]:
    """`compute` on the rows sorted by `expert`, its result put back in the rows' order."""
    s = sort_by_expert(expert, n_experts)
    unsort = inverse_permutation(s.order)
    out_sorted = compute(permute_rows(rows, s.order, unsort), s)
    return permute_rows(out_sorted, unsort, s.order)


def sorted_dispatch(
    x: Float[Array, "B S D"], routing: Routing, compute: SortedCompute, moe: MoEConfig
) -> Float[Array, "B S D"]:
    """Sort assignments by expert, `compute` the sorted rows, unsort and combine.

    `compute` maps rows sorted by expert to their expert outputs; the expert-parallel
    wrapper passes one that ships rows to the device holding their expert and back.
    """
    b, s_len, d = x.shape
    k = routing.experts.shape[-1]
    assignments = jnp.repeat(x.reshape(-1, d), k, axis=0)  # row t * k + j: token t
    out = in_expert_order(assignments, routing.experts.reshape(-1), moe.n_experts, compute)
    out = out.reshape(-1, k, d)
    y = jnp.einsum("tk,tkd->td", routing.weights.reshape(-1, k).astype(x.dtype), out)
    return y.reshape(b, s_len, d)


def dropless_dispatch(
    x: Float[Array, "B S D"], routing: Routing, experts: Experts, moe: MoEConfig
) -> tuple[Float[Array, "B S D"], Drops]:
    """Every assignment is computed: y[t] = sum_k w[t, k] * expert_{e[t, k]}(x[t])."""
    compute = lambda rows, s: grouped_experts(rows, s, experts, moe)
    return sorted_dispatch(x, routing, compute, moe), Drops.at_expert(0)
