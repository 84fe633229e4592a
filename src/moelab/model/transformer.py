"""The decoder-only MoE transformer (pre-norm, residual), in the style of Qwen3-MoE.

    h = x + Attention(RMSNorm(x))
    y = h + FFN(RMSNorm(h))        FFN = dense SwiGLU for the first n_dense_layers, else MoE
    logits = RMSNorm(y_L) @ W_out  (W_out = embedding^T when tied)

The model knows nothing about devices or meshes; `moelab.parallel` shards it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from moelab.config import ModelConfig, MoEConfig
from moelab.model.attention import Attention, KVCache
from moelab.model.layers import RMSNorm, SwiGLU, normal, rope_angles
from moelab.model.moe import MoE, MoEStats


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    ffn_norm: RMSNorm
    ffn: MoE | SwiGLU

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, dense: bool, key: PRNGKeyArray):
        ka, kf = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, ka)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        d_dense = cfg.d_ff_dense or cfg.d_ff * moe.top_k
        self.ffn = (SwiGLU(cfg.d_model, d_dense, cfg.init_std, kf) if dense
                    else MoE.init(cfg, moe, kf))

    def __call__(self, x, cos, sin, cache=None, cache_index=0):
        attended, cache = self.attn(self.attn_norm(x), cos, sin, cache, cache_index)
        h = x + attended
        if isinstance(self.ffn, MoE):
            out, stats = self.ffn(self.ffn_norm(h))
        else:
            out, stats = self.ffn(self.ffn_norm(h)), None
        return h + out, stats, cache


class Transformer(eqx.Module):
    embed: Float[Array, "V D"]
    blocks: list[Block]
    final_norm: RMSNorm
    lm_head: Float[Array, "D V"] | None  # None when tied to the embedding
    cfg: ModelConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, key: PRNGKeyArray):
        ke, kh, *kb = jax.random.split(key, cfg.n_layers + 2)
        self.embed = normal(ke, (cfg.vocab_size, cfg.d_model), cfg.init_std)
        self.blocks = [Block(cfg, moe, i < cfg.n_dense_layers, kb[i]) for i in range(cfg.n_layers)]
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else normal(
            kh, (cfg.d_model, cfg.vocab_size), cfg.init_std)
        self.cfg = cfg

    def __call__(
        self,
        tokens: Int[Array, "B S"],
        caches: list[KVCache] | None = None,
        cache_index: Array | int = 0,
    ) -> tuple[Float[Array, "B S V"], MoEStats | None, list[KVCache] | None]:
        """Logits for every position, stacked per-MoE-layer stats, updated caches."""
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s) + cache_index, (b, s))
        cos, sin = rope_angles(positions, self.cfg.resolved_head_dim, self.cfg.rope_theta)
        x = self.embed[tokens]
        layer_stats, new_caches = [], []
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches is not None else None
            x, stats, cache = block(x, cos.astype(x.dtype), sin.astype(x.dtype), cache, cache_index)
            new_caches.append(cache)
            if stats is not None:
                layer_stats.append(stats)
        x = self.final_norm(x)
        head = self.embed.T if self.lm_head is None else self.lm_head
        logits = jnp.einsum("bsd,dv->bsv", x, head.astype(x.dtype)).astype(jnp.float32)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *layer_stats) if layer_stats else None
        return logits, stacked, new_caches if caches is not None else None

    def init_caches(self, batch: int, max_len: int, dtype=jnp.float32) -> list[KVCache]:
        c = self.cfg
        shape = (batch, max_len, c.n_kv_heads, c.resolved_head_dim)
        return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in self.blocks]
