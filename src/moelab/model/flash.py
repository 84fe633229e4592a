"""Causal attention in key/value chunks with an online softmax (FlashAttention-2's schedule,
Dao 2023), for `model.attention_impl: chunked`.

Queries and keys are cut into `chunk`-position blocks. Query block i visits key blocks
0..i (the blocks above the diagonal are never computed) keeping a running max, sum of
exponentials and weighted sum of values per query row, so no [S, S] array exists. The
forward keeps only q, k, v, the output and each row's log-sum-exp; the backward (a custom
VJP) recomputes each block's probabilities from them:

    p = exp(s - lse)     dv_j += p^T do     ds = p * (do v_j^T - rowsum(do * o))
    dq_i += scale ds k_j     dk_j += scale ds^T q_i

Memory for forward and backward is O(S) plus one [G*chunk, chunk] block per kv head: linear
in the sequence. XLA has no fused attention kernel on CPU (jax.nn.dot_product_attention's
"xla" implementation builds the whole [T, S] logits), hence this one.

Layout as in attention.py: query heads grouped over their kv head (query head = kv_head *
groups + g), each group's rows stacked along the query axis, so every product is a batched
2-D matmul over z = batch x kv head.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_LOW = float(jnp.finfo(jnp.float32).min)  # a masked logit: finite, so m - m_new is never NaN


def chunked_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B S KV K"],
    v: Float[Array, "B S KV K"],
    scale: float,
    chunk: int,
    segments: Int[Array, "B S"] | None = None,
) -> Float[Array, "B S H K"]:
    """softmax(scale q k^T + causal mask) v; with `segments`, a query sees only keys of its
    own segment id. The length is padded up to a multiple of `chunk`: padded keys lie after
    every real query (masked), padded queries are cut off (and get a segment of their own)."""
    b, s, h, hd = q.shape
    n_kv = k.shape[2]
    n = -(-s // chunk)
    pad = lambda a, value=0: jnp.pad(a, ((0, 0), (0, n * chunk - s)) + ((0, 0),) * (a.ndim - 2),
                                     constant_values=value)
    if segments is None:
        segments = jnp.zeros((b, s), jnp.int32)
    # q: [B, S, KV, G, K] -> blocks [n, B*KV, G*chunk, K]; k, v: [B*KV, n*chunk, K]
    qz = pad(q).reshape(b, n, chunk, n_kv, h // n_kv, hd).transpose(1, 0, 3, 4, 2, 5)
    qz = qz.reshape(n, b * n_kv, -1, hd)
    kv_major = lambda a: pad(a).transpose(0, 2, 1, 3).reshape(b * n_kv, n * chunk, hd)
    out = _flash(qz, kv_major(k), kv_major(v), pad(segments, -1), scale, chunk, n_kv)
    out = out.reshape(n, b, n_kv, h // n_kv, chunk, hd).transpose(1, 0, 4, 2, 3, 5)
    return out.reshape(b, n * chunk, h, hd)[:, :s]


def _block_mask(segments: Array, i: Array, j: Array, chunk: int, n_kv: int,
                groups: int) -> Array:
    """[B*KV, G*chunk, chunk]: query block i's rows (group-major) against key block j."""
    qpos = i * chunk + jnp.arange(chunk)
    kpos = j * chunk + jnp.arange(chunk)
    seg_q = jax.lax.dynamic_slice_in_dim(segments, i * chunk, chunk, axis=1)
    seg_k = jax.lax.dynamic_slice_in_dim(segments, j * chunk, chunk, axis=1)
    mask = (qpos[:, None] >= kpos[None, :]) & (seg_q[:, :, None] == seg_k[:, None, :])
    b = segments.shape[0]
    mask = jnp.broadcast_to(mask[:, None, None], (b, n_kv, groups, chunk, chunk))
    return mask.reshape(b * n_kv, groups * chunk, chunk)


def _scores(qi: Array, kj: Array, scale: float) -> Array:
    return jnp.einsum("zqd,ztd->zqt", qi, kj, preferred_element_type=jnp.float32) * scale


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, segments, scale, chunk, n_kv):
    return _forward(q, k, v, segments, scale, chunk, n_kv)[0]


def _forward(q, k, v, segments, scale, chunk, n_kv):
    """Output blocks [n, Z, G*chunk, K] and each row's log-sum-exp [n, Z, G*chunk]."""
    z, rows, hd = q.shape[1:]
    groups = rows // chunk
    key_block = lambda a, j: jax.lax.dynamic_slice_in_dim(a, j * chunk, chunk, axis=1)

    def query_block(_, qi_i):
        qi, i = qi_i

        def key_step(j, carry):
            m, total, acc = carry
            mask = _block_mask(segments, i, j, chunk, n_kv, groups)
            s = jnp.where(mask, _scores(qi, key_block(k, j), scale), _LOW)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum("zqt,ztd->zqd", p.astype(v.dtype), key_block(v, j),
                            preferred_element_type=jnp.float32)
            return m_new, total * correction + p.sum(-1), acc * correction[..., None] + pv

        init = (jnp.full((z, rows), _LOW), jnp.zeros((z, rows)), jnp.zeros((z, rows, hd)))
        m, total, acc = jax.lax.fori_loop(0, i + 1, key_step, init)  # key blocks 0..i only
        return None, ((acc / total[..., None]).astype(q.dtype), m + jnp.log(total))

    _, (out, lse) = jax.lax.scan(query_block, None, (q, jnp.arange(q.shape[0])))
    return out, lse


def _flash_fwd(q, k, v, segments, scale, chunk, n_kv):
    out, lse = _forward(q, k, v, segments, scale, chunk, n_kv)
    return out, (q, k, v, segments, out, lse)


def _flash_bwd(scale, chunk, n_kv, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    z, rows, hd = q.shape[1:]
    groups = rows // chunk
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    key_block = lambda a, j: jax.lax.dynamic_slice_in_dim(a, j * chunk, chunk, axis=1)

    def add_block(total, j, part):
        return jax.lax.dynamic_update_slice_in_dim(total, key_block(total, j) + part,
                                                   j * chunk, axis=1)

    def query_block(dkv, block):
        qi, doi, lse_i, delta_i, i = block

        def key_step(j, carry):
            dq, dk, dv = carry
            kj, vj = key_block(k, j), key_block(v, j)
            mask = _block_mask(segments, i, j, chunk, n_kv, groups)
            p = jnp.where(mask, jnp.exp(_scores(qi, kj, scale) - lse_i[..., None]), 0.0)
            dv = add_block(dv, j, jnp.einsum("zqt,zqd->ztd", p, doi.astype(jnp.float32)))
            dp = jnp.einsum("zqd,ztd->zqt", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None]) * scale
            dq = dq + jnp.einsum("zqt,ztd->zqd", ds, kj.astype(jnp.float32))
            dk = add_block(dk, j, jnp.einsum("zqt,zqd->ztd", ds, qi.astype(jnp.float32)))
            return dq, dk, dv

        dq, dk, dv = jax.lax.fori_loop(0, i + 1, key_step, (jnp.zeros((z, rows, hd)), *dkv))
        return (dk, dv), dq

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros),
                                (q, d_out, lse, delta, jnp.arange(q.shape[0])))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
