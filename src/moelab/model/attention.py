"""Grouped-query causal self-attention with QK-norm and rotary embeddings.

QK-norm (an RMSNorm over each head's queries and keys before RoPE) bounds attention
logits; it was the key fix for loss spikes in large open runs. Without a KV cache the causal
attention runs as `model.attention_impl` says (CAUSAL_ATTENTION): "dense" below, or
"chunked", the online-softmax blocks of model/flash.py.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from moelab.config import ModelConfig
from moelab.model.flash import chunked_attention
from moelab.model.layers import RMSNorm, apply_rope, linear, normal

# Causal attention without a cache runs in at most MAX_QUERY_CHUNKS query chunks, unrolled,
# each against only the keys at or before its last position, so the fully masked blocks
# above the diagonal are never computed (S=256 in chunks of 64: 3/8 of the square skipped).
# Chunks of 64 were fastest on CPU for S 128..256 (32 lost to per-op overhead). Up to
# SHORT_LIMIT tokens (the training lengths) that is all, and the backward pass keeps each
# chunk's probabilities. Past it, that would be the S^2/2 triangle, so each chunk runs its
# queries LONG_QUERY_CHUNK at a time in a `lax.scan` whose body is under `jax.checkpoint`:
# the backward keeps q, k, v (linear in S) and recomputes one sub-chunk's probabilities
# at a time. (Unrolled checkpointed chunks are not enough: XLA:CPU drops the barriers that
# keep a recomputation apart, merges it with the forward and runs chunks side by side, so
# the triangle stays live; a loop iteration cannot be merged or overlapped.) A chunk's
# sub-chunks all see that chunk's keys: 1/16 of the square is computed masked, not skipped.
QUERY_CHUNK = 64
MAX_QUERY_CHUNKS = 8
SHORT_LIMIT = QUERY_CHUNK * MAX_QUERY_CHUNKS
LONG_QUERY_CHUNK = 128


def causal_chunks(s: int) -> list[tuple[int, int]]:
    """[start, end) of each (unrolled) query chunk of a length-s causal attention: chunks of
    QUERY_CHUNK up to SHORT_LIMIT, else at most MAX_QUERY_CHUNKS whole LONG_QUERY_CHUNKs."""
    unit = QUERY_CHUNK if s <= SHORT_LIMIT else LONG_QUERY_CHUNK
    size = unit * max(1, -(-s // (unit * MAX_QUERY_CHUNKS)))
    return [(a, min(a + size, s)) for a in range(0, s, size)]


class KVCache(eqx.Module):
    """Keys and values of the positions decoded so far, for incremental generation."""

    k: Float[Array, "B T KV K"]
    v: Float[Array, "B T KV K"]


class Attention(eqx.Module):
    wq: Float[Array, "D HK"]
    wk: Float[Array, "D GK"]
    wv: Float[Array, "D GK"]
    wo: Float[Array, "HK D"]
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    logit_scale: float = eqx.field(static=True, default=1.0)  # model.attn_logit_scale
    impl: str = eqx.field(static=True, default="dense")  # model.attention_impl
    chunk: int = eqx.field(static=True, default=256)  # model.attention_chunk

    @classmethod
    def init(cls, cfg: ModelConfig, key: PRNGKeyArray) -> Attention:
        hd, h, kv = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
        kq, kk, kvk, ko = jax.random.split(key, 4)
        norm = lambda: RMSNorm.init(hd, cfg.norm_eps) if cfg.qk_norm else None
        return cls(wq=normal(kq, (cfg.d_model, h * hd), cfg.init_std),
                   wk=normal(kk, (cfg.d_model, kv * hd), cfg.init_std),
                   wv=normal(kvk, (cfg.d_model, kv * hd), cfg.init_std),
                   wo=normal(ko, (h * hd, cfg.d_model), cfg.init_std),
                   q_norm=norm(), k_norm=norm(), n_heads=h, n_kv_heads=kv, head_dim=hd,
                   logit_scale=cfg.attn_logit_scale, impl=cfg.attention_impl,
                   chunk=cfg.attention_chunk)

    def __call__(
        self,
        x: Float[Array, "B S D"],
        cos: Array,
        sin: Array,
        cache: KVCache | None = None,
        cache_index: Array | int = 0,
        segments: Int[Array, "B S"] | None = None,
    ) -> tuple[Float[Array, "B S D"], KVCache | None]:
        """Attend causally; with a cache, x holds new positions starting at cache_index.
        With `segments` (no cache), a query sees only keys of its own segment id: windows
        packed in one row attend as if each were its own sequence (RoPE is relative)."""
        b, s, _ = x.shape
        q = linear(x, self.wq).reshape(b, s, self.n_heads, self.head_dim)
        k = linear(x, self.wk).reshape(b, s, self.n_kv_heads, self.head_dim)
        v = linear(x, self.wv).reshape(b, s, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = CAUSAL_ATTENTION[self.impl](self, q, k, v, segments)
        else:
            write = lambda old, new: jax.lax.dynamic_update_slice_in_dim(
                old, new.astype(old.dtype), cache_index, 1)
            k, v = write(cache.k, k), write(cache.v, v)
            cache = KVCache(k, v)
            mask = _causal(cache_index, s, k.shape[1])
            out = self._attend(q, k.astype(q.dtype), v.astype(q.dtype), mask)
        return linear(out.reshape(b, s, -1), self.wo), cache

    def _dense(self, q: Array, k: Array, v: Array, segments: Array | None) -> Array:
        """Query chunk by chunk, each against the keys it can see (`causal_chunks`)."""
        chunk = self._attend_short if q.shape[1] <= SHORT_LIMIT else self._attend_long
        return jnp.concatenate([chunk(q[:, a:e], k[:, :e], v[:, :e], a, segments)
                                for a, e in causal_chunks(q.shape[1])], axis=1)

    def _chunked(self, q: Array, k: Array, v: Array, segments: Array | None) -> Array:
        """Key/value blocks with an online softmax, recomputed in backward (model/flash.py)."""
        return chunked_attention(q, k, v, self.logit_scale / math.sqrt(self.head_dim),
                                 self.chunk, segments)

    def _attend_short(self, q: Array, k: Array, v: Array, first: int,
                      segments: Array | None) -> Array:
        """Queries at first.. against every key of k, the probabilities kept for backward."""
        return self._attend(q, k, v, _mask(first, q.shape[1], k.shape[1], segments))

    def _attend_long(self, q: Array, k: Array, v: Array, first: int,
                     segments: Array | None) -> Array:
        """The same, LONG_QUERY_CHUNK queries at a time (the tail padded), each recomputed
        in the backward pass: memory linear in the keys for a fixed sub-chunk size."""
        b, s = q.shape[:2]
        c = LONG_QUERY_CHUNK
        n = -(-s // c)
        q = jnp.pad(q, ((0, 0), (0, n * c - s), (0, 0), (0, 0)))
        if segments is not None:  # padded queries: any id, their rows are cut off below
            segments = jnp.pad(segments, ((0, 0), (0, max(0, first + n * c - segments.shape[1]))))

        @jax.checkpoint
        def sub_chunk(_, start):
            rows = jax.lax.dynamic_slice_in_dim(q, start, c, axis=1)
            return None, self._attend(rows, k, v,
                                      _mask(first + start, c, k.shape[1], segments))

        _, out = jax.lax.scan(sub_chunk, None, jnp.arange(n) * c)  # [n, B, c, KV, G, K]
        return jnp.moveaxis(out, 0, 1).reshape(b, n * c, *out.shape[3:])[:, :s]

    def _attend(self, q: Array, k: Array, v: Array, mask: Array) -> Array:
        """softmax(logit_scale q k^T / sqrt(d)) v, query heads grouped over shared kv heads.

        Computed head-major: each kv head's query group stacked along the query axis
        ([B*KV, G*S, K] against [B*KV, T, K]), so both products are plain batched 2-D
        matmuls (15% less CPU time for the layer's fwd+bwd than a 5-D einsum, measured).
        """
        b, s, _, hd = q.shape
        t, n, groups = k.shape[1], self.n_kv_heads, self.n_heads // self.n_kv_heads
        # query head = kv_head * groups + g
        q = q.reshape(b, s, n, groups, hd).transpose(0, 2, 3, 1, 4).reshape(b * n, groups * s, hd)
        heads_first = lambda a: a.transpose(0, 2, 1, 3).reshape(b * n, t, hd)
        logits = jnp.einsum("zqk,ztk->zqt", q, heads_first(k)).astype(jnp.float32)
        logits = logits * (self.logit_scale / jnp.sqrt(hd))
        if mask.ndim == 3:  # per sequence [B, S, T] -> [B*KV, G*S, T], as the logits
            mask = jnp.broadcast_to(mask[:, None, None], (b, n, groups, s, t)).reshape(
                b * n, groups * s, t)
        else:
            mask = jnp.tile(mask, (groups, 1))
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("zqt,ztk->zqk", probs, heads_first(v))
        return out.reshape(b, n, groups, s, hd).transpose(0, 3, 1, 2, 4)


# model.attention_impl -> how causal attention without a cache runs: (attn, q, k, v, segments)
CAUSAL_ATTENTION = {"dense": Attention._dense, "chunked": Attention._chunked}


def _mask(first: Array | int, queries: int, keys: int, segments: Array | None) -> Array:
    """The causal mask [queries, keys], and with segments [B, queries, keys]: also only keys
    of the query's segment (segments [B, >= first + queries] covers the queries' positions;
    keys are positions 0..keys-1)."""
    causal = _causal(first, queries, keys)
    if segments is None:
        return causal
    seg_q = jax.lax.dynamic_slice_in_dim(segments, first, queries, axis=1)
    return causal[None] & (seg_q[:, :, None] == segments[:, None, :keys])


def _causal(first: Array | int, queries: int, keys: int) -> Array:
    """[queries, keys] mask: query i sits at position first + i and sees keys <= it."""
    return (jnp.arange(queries) + first)[:, None] >= jnp.arange(keys)[None, :]
