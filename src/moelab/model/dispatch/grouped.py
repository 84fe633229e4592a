"""The CPU grouped SwiGLU: each expert's run of sorted rows as a few large 2-D matmuls.

XLA:CPU has no grouped GEMM (`ragged_dot` lowers to a dense product over every expert,
E times the FLOPs). Padding every expert's run to fixed blocks and gathering each block's
weights costs a copy of the expert weights per block and runs small matmuls (measured:
1.8x the CPU time of a dense SwiGLU of equal FLOPs, B8 S256 D256 F512 E8 top-2). This
kernel instead loops, with dynamic trip counts, over each expert's rows *where they lie*:
chunks of `CHUNK_BLOCKS * block` rows while a full chunk fits, then the tail rounded up to
whole blocks in one chunk per binary digit (of 4, 2 and 1 blocks, or one of 8 where the
tail rounds up to a full chunk: at most 3 chunks), the last one shifted back to end at the
run's end (rows it shares with the previous chunk, or with the previous expert's run when
the run is short, are masked, so each row counts once). Compute is therefore the rows
themselves plus fewer than `block` rows per expert, as plain 2-D matmuls, and an uneven
run costs few extra matmuls: with the earlier tail of up to 3 chunks of `block` rows after
chunks of 4 blocks, real routing took 1.16x the time of exactly uniform routing; now 1.07x
(fwd+bwd, B8 S256 D256 F512 E8 top-2, bench/results/benchmarks/moe_layer.json). Every read stays
inside the rows, so nothing is padded or copied around the loop (padding the rows and the
incoming gradient cost 10-12% of the kernel's fwd+bwd time, measured side by side); a
full chunk owns all its rows and writes them without a mask.

A `while` loop with a data-dependent trip count has no reverse-mode derivative in JAX,
so the backward pass is written out (`jax.custom_vjp`): the same loop over the same
chunks, with gate and up saved from the forward pass.

`slab_swiglu` computes the same rows another way: every expert's first
ceil(rows / experts) rows (rounded up to 8) gathered into one [E, cap, D] batch of static
shape, and only the rows past an expert's cap through the loop above. Where experts are
narrow, the loop's chunks are small matmuls that cost less than the ops around them, and
the batch replaces most of them (the tiny preset: 1.11x the loop for its MoE layer).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# (carry, expert, first row read, first row owned, end of rows owned, rows read) -> carry;
# first/end owned are None for a full chunk, which owns every row it reads
ChunkBody = Callable[[tuple, Array, Array, Array, Array, int], tuple]
CHUNK_BLOCKS = 8  # blocks per full chunk; a power of 2, so a tail of up to this many blocks
# is one chunk per binary digit


@jax.custom_vjp
def permute_rows(x: Float[Array, "N D"], index: Int[Array, " N"], inverse: Int[Array, " N"]):
    """x[index] for a permutation `index` whose inverse is `inverse`.

    The transpose of a permutation is its inverse, so the backward pass is a gather too
    (autodiff of x[index] would scatter-add, which XLA:CPU runs row by row).
    """
    return x[index]


def _permute_fwd(x, index, inverse):
    return x[index], (index, inverse)


def _permute_bwd(res, dy):
    _, inverse = res
    return dy[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def inverse_permutation(index: Int[Array, " N"]) -> Int[Array, " N"]:
    n = index.shape[0]
    return jnp.zeros(n, index.dtype).at[index].set(jnp.arange(n, dtype=index.dtype))


def _for_each_chunk(group_sizes: Int[Array, " E"], block: int, body: ChunkBody, carry):
    """Run `body` over the chunks of every expert's run of rows (see the module doc)."""
    end = jnp.cumsum(group_sizes)
    return _for_each_run_chunk(end - group_sizes, group_sizes, block, body, carry)


def _for_each_run_chunk(start: Int[Array, " E"], count: Int[Array, " E"], block: int,
                        body: ChunkBody, carry):
    """`body` over the chunks of rows [start[e], start[e] + count[e]) of every expert e:
    full chunks of `chunk_rows(block)` rows while one fits, then the tail rounded up to
    whole blocks in chunks of 2^i blocks, one per binary digit (largest first), the last
    one shifted back to end at the run's end (the rows it then reads before its own
    belong to the chunk before it or to the previous expert: masked)."""
    big = chunk_rows(block)
    n_big = count // big
    tail = count - n_big * big

    def expert(e, carry):
        last = start[e] + count[e]

        def big_chunk(j, carry):
            return body(carry, e, start[e] + j * big, None, None, big)

        carry = jax.lax.fori_loop(0, n_big[e], big_chunk, carry)
        blocks = -(-tail[e] // block)
        first = start[e] + n_big[e] * big  # of the rows the next tail chunk owns
        for bit in reversed(range(CHUNK_BLOCKS.bit_length())):
            size = block << bit
            runs = (blocks >> bit) & 1

            def tail_chunk(j, carry, size=size, first=first):
                # j is always 0 here, but reading through it keeps XLA from hoisting the
                # chunk out of its loop as loop-invariant code, which then ran for every
                # expert and every size whether or not the loop ran (measured: the
                # kernel's fwd+bwd 1.5-1.9x slower)
                read = jnp.maximum(jnp.minimum(first, last - size) - j, 0)
                return body(carry, e, read, first, jnp.minimum(first + size, last), size)

            carry = jax.lax.fori_loop(0, runs, tail_chunk, carry)
            first = first + runs * size
        return carry

    return jax.lax.fori_loop(0, count.shape[0], expert, carry)


def chunk_rows(block: int) -> int:
    """Rows of a full chunk: CHUNK_BLOCKS blocks."""
    return CHUNK_BLOCKS * block


def _rows(x: Array, read: Array, n: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, read, n, 0)


def _owned(read: Array, lo: Array, hi: Array, n: int) -> Array | None:
    """Which of the n rows read from `read` this chunk owns: [lo, hi); None: all of them."""
    if lo is None:
        return None
    r = read + jnp.arange(n)
    return ((r >= lo) & (r < hi))[:, None]


def _write(buf: Array, new: Array, read: Array, owned: Array | None) -> Array:
    if owned is not None:
        new = jnp.where(owned, new, _rows(buf, read, new.shape[0]))
    return jax.lax.dynamic_update_slice_in_dim(buf, new, read, 0)


def _pad(x: Array, rows: int) -> Array:
    """Room past the end, so a chunk read near the end stays in bounds."""
    return jnp.concatenate([x, jnp.zeros((rows, *x.shape[1:]), x.dtype)])


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_swiglu(
    rows: Float[Array, "A D"],
    group_sizes: Int[Array, " E"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    block: int,
) -> Float[Array, "A D"]:
    """Row i (sorted by expert, group_sizes rows each) through its expert's SwiGLU."""
    return _forward(rows, group_sizes, w_gate, w_up, w_down, block)[0]


def _forward(rows, group_sizes, w_gate, w_up, w_down, block):
    n, d = rows.shape
    f = w_gate.shape[-1]
    pad = max(chunk_rows(block) - n, 0)  # every chunk reads in bounds
    x = _pad(rows, pad) if pad else rows

    def chunk(carry, e, read, lo, hi, size):
        y, gate, up = carry
        xs = _rows(x, read, size)
        g, u = xs @ w_gate[e], xs @ w_up[e]
        out = (jax.nn.silu(g) * u) @ w_down[e]
        owned = _owned(read, lo, hi, size)
        return _write(y, out, read, owned), _write(gate, g, read, owned), _write(up, u, read, owned)

    zeros = lambda width: jnp.zeros((n + pad, width), rows.dtype)
    y, gate, up = _for_each_chunk(group_sizes, block, chunk, (zeros(d), zeros(f), zeros(f)))
    return y[:n], (x, gate, up, group_sizes, w_gate, w_up, w_down)


def _backward(block, res, dy):
    x, gate, up, group_sizes, w_gate, w_up, w_down = res
    n = dy.shape[0]
    dy = _pad(dy, x.shape[0] - n) if x.shape[0] > n else dy
    saved = lambda e, read, size, xs: (_rows(gate, read, size), _rows(up, read, size))
    chunk = _backward_chunk(x, dy, w_gate, w_up, w_down, saved)
    f32 = lambda w: jnp.zeros(w.shape, jnp.float32)  # accumulate weight grads in float32
    init = (jnp.zeros_like(x), f32(w_gate), f32(w_up), f32(w_down))
    return _cotangents(_for_each_chunk(group_sizes, block, chunk, init), n, w_gate, w_up,
                       w_down)


def _backward_chunk(x, dy, w_gate, w_up, w_down, gate_up) -> ChunkBody:
    """The backward loop's body: one chunk's input and weight gradients, added to the
    carry (dx, dw_gate, dw_up, dw_down); `gate_up(e, read, size, xs)` gives the chunk's
    gate and up, saved by the forward pass or computed again."""

    def chunk(carry, e, read, lo, hi, size):
        dx, dw_gate, dw_up, dw_down = carry
        owned = _owned(read, lo, hi, size)
        xs, dys = _rows(x, read, size), _rows(dy, read, size)
        if owned is not None:
            dys = jnp.where(owned, dys, 0)  # rows owned elsewhere add nothing
        g, u = gate_up(e, read, size, xs)
        dxs, dwg, dwu, dwd = _swiglu_grads(xs, g, u, dys, w_gate[e], w_up[e], w_down[e])
        acc = lambda w, grad: w.at[e].add(grad.astype(w.dtype))
        return _write(dx, dxs, read, owned), acc(dw_gate, dwg), acc(dw_up, dwu), acc(dw_down, dwd)

    return chunk


def _cotangents(grads, n, w_gate, w_up, w_down):
    """The custom VJP's cotangents from the loop's carry: dx cut to the n rows, none for
    the group sizes, the float32 weight gradients in the weights' dtype."""
    dx, dw_gate, dw_up, dw_down = grads
    cast = lambda grad, w: grad.astype(w.dtype)
    return (dx[:n], None, cast(dw_gate, w_gate), cast(dw_up, w_up), cast(dw_down, w_down))


grouped_swiglu.defvjp(lambda *a: _forward(*a), _backward)


def _swiglu_grads(x, g, u, dy, w_gate, w_up, w_down):
    """Gradients of rows through silu(x @ w_gate) * (x @ w_up) @ w_down, given the gate g,
    up u and output gradient dy: (dx, dw_gate, dw_up, dw_down). 2-D arrays, or batched
    over a leading expert axis."""
    t = lambda a: jnp.swapaxes(a, -1, -2)
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    dh = dy @ t(w_down)
    du = dh * silu
    dg = dh * u * sig * (1 + g * (1 - sig))  # d silu(g) / dg
    return dg @ t(w_gate) + du @ t(w_up), t(x) @ dg, t(x) @ du, t(silu * u) @ dy


# ---------------------------------------------------------------------- slab


def slab_capacity(n_rows: int, n_experts: int) -> int:
    """Rows per expert in the slab: the balanced share, rounded up to a multiple of 8."""
    return 8 * -(-n_rows // (8 * n_experts))


def _slab_layout(group_sizes: Int[Array, " E"], n: int, cap: int):
    """Where the slab's rows come from and where each sorted row's output lies.

    src[e, c]: the sorted row in slot c of expert e (n, out of range, for an empty slot);
    slot[i]: sorted row i's slot in the flattened slab (E * cap, out of range, for a row
    past its expert's first cap); and each expert's rows past the slab: their first row
    and count, for the blocked loop.
    """
    n_experts = group_sizes.shape[0]
    end = jnp.cumsum(group_sizes)
    start = end - group_sizes
    c = jnp.arange(cap)
    src = jnp.where(c[None] < group_sizes[:, None], start[:, None] + c[None], n)
    expert = jnp.repeat(jnp.arange(n_experts), group_sizes, total_repeat_length=n)
    pos = jnp.arange(n) - start[expert]
    slot = jnp.where(pos < cap, expert * cap + pos, n_experts * cap)
    in_slab = jnp.minimum(group_sizes, cap)
    return src, slot, start + in_slab, group_sizes - in_slab


def _take(x: Array, index: Array) -> Array:
    """x[index] along axis 0, zero rows where the index is out of range."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def slab_swiglu(
    rows: Float[Array, "A D"],
    group_sizes: Int[Array, " E"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    block: int,
) -> Float[Array, "A D"]:
    """`grouped_swiglu`'s result, computed as a slab: every expert's first
    `slab_capacity` rows gathered into one [E, cap, D] batch of static shape and run as
    batched matmuls (empty slots are zero rows, which add nothing), and the rows past an
    expert's cap through the blocked loop. Nothing is dropped. Balanced routing leaves
    few rows past the cap, and the batch replaces the loop's many small matmuls, which
    cost most where the experts are narrow; with every row on one expert, the slab's
    empty slots double the work."""
    return _slab_forward(rows, group_sizes, w_gate, w_up, w_down, block)[0]


def _slab_forward(rows, group_sizes, w_gate, w_up, w_down, block):
    n, d = rows.shape
    n_experts = w_gate.shape[0]
    cap = slab_capacity(n, n_experts)
    src, slot, first, over = _slab_layout(group_sizes, n, cap)
    xs = _take(rows, src)  # [E, cap, D]
    g, u = xs @ w_gate, xs @ w_up
    out = (jax.nn.silu(g) * u) @ w_down
    pad = max(chunk_rows(block) - n, 0)  # the loop's chunk reads stay in bounds
    x = _pad(rows, pad) if pad else rows
    y = _take(out.reshape(-1, d), slot)  # rows past the cap are zero here
    y = _pad(y, pad) if pad else y

    def chunk(y, e, read, lo, hi, size):
        xr = _rows(x, read, size)
        o = (jax.nn.silu(xr @ w_gate[e]) * (xr @ w_up[e])) @ w_down[e]
        return _write(y, o, read, _owned(read, lo, hi, size))

    y = _for_each_run_chunk(first, over, block, chunk, y)
    return y[:n], (x, xs, g, u, src, slot, first, over, w_gate, w_up, w_down)


def _slab_backward(block, res, dy):
    x, xs, g, u, src, slot, first, over, w_gate, w_up, w_down = res
    n, d = dy.shape
    dxs, *dw = _swiglu_grads(xs, g, u, _take(dy, src), w_gate, w_up, w_down)
    dw_gate, dw_up, dw_down = (grad.astype(jnp.float32) for grad in dw)  # as the loop's
    dx = _take(dxs.reshape(-1, d), slot)
    pad = x.shape[0] - n
    dx, dy = (_pad(dx, pad), _pad(dy, pad)) if pad else (dx, dy)

    again = lambda e, read, size, xs: (xs @ w_gate[e], xs @ w_up[e])  # rows past the cap
    chunk = _backward_chunk(x, dy, w_gate, w_up, w_down, again)
    grads = _for_each_run_chunk(first, over, block, chunk, (dx, dw_gate, dw_up, dw_down))
    return _cotangents(grads, n, w_gate, w_up, w_down)


slab_swiglu.defvjp(lambda *a: _slab_forward(*a), _slab_backward)
