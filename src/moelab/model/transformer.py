"""The decoder-only MoE transformer (pre-norm, residual), in the style of Qwen3-MoE.

    h = x + Attention(RMSNorm(x))
    y = h + FFN(RMSNorm(h))        FFN = dense SwiGLU for the first n_dense_layers, else MoE
    logits = RMSNorm(y_L) @ W_out  (W_out = embedding^T when tied)

The repeated layers are stacked: every array of the dense prefix has a leading axis of
n_dense_layers and every array of the MoE layers one of n_layers - n_dense_layers, and each
stack runs under `jax.lax.scan` (compile time independent of depth) or, with
`model.scan_layers: false`, an unrolled loop over the same arrays. `model.remat` wraps
each layer in `jax.checkpoint` with a named policy.

The model knows nothing about devices or meshes; `moelab.parallel` shards it.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from moelab.config import ModelConfig, MoEConfig
from moelab.model.attention import Attention, KVCache
from moelab.model.dispatch import DROPLESS
from moelab.model.layers import RMSNorm, SwiGLU, linear, normal, rope_angles
from moelab.model.moe import SAVE_MOE_NAMES, MoE, MoEStats


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    ffn_norm: RMSNorm
    ffn: MoE | SwiGLU

    @classmethod
    def init(cls, cfg: ModelConfig, moe: MoEConfig, dense: bool, key: PRNGKeyArray) -> Block:
        ka, kf = jax.random.split(key)
        d_dense = cfg.d_ff_dense or cfg.d_ff * moe.top_k
        return cls(attn_norm=RMSNorm.init(cfg.d_model, cfg.norm_eps),
                   attn=Attention.init(cfg, ka),
                   ffn_norm=RMSNorm.init(cfg.d_model, cfg.norm_eps),
                   ffn=(SwiGLU.init(cfg.d_model, d_dense, cfg.init_std, kf) if dense
                        else MoE.init(cfg, moe, kf)))

    def __call__(self, x, cos, sin, cache=None, cache_index=0, segments=None):
        # the named scopes label the ops in a profile (bench/profile_step.py, TensorBoard)
        with jax.named_scope("attention"):
            attended, cache = self.attn(self.attn_norm(x), cos, sin, cache, cache_index,
                                        segments)
        h = x + attended
        if isinstance(self.ffn, MoE):
            out, stats = self.ffn(self.ffn_norm(h))
        else:
            with jax.named_scope("dense_ffn"):
                out, stats = self.ffn(self.ffn_norm(h)), None
        return h + out, stats, cache


class Transformer(eqx.Module):
    embed: Float[Array, "V D"]
    dense_layers: Block | None  # the dense prefix, stacked: arrays [n_dense_layers, ...]
    moe_layers: Block | None  # the MoE layers, stacked: arrays [n_layers - n_dense, ...]
    final_norm: RMSNorm
    lm_head: Float[Array, "D V"] | None  # None when tied to the embedding
    cfg: ModelConfig = eqx.field(static=True)
    # multi-token prediction modules (model/mtp.py), trained beside the model, used by the
    # training loss only; None without them (mtp.depth 0) and in every inference path
    mtp: eqx.Module | None = None

    @classmethod
    def init(cls, cfg: ModelConfig, moe: MoEConfig, key: PRNGKeyArray) -> Transformer:
        """Fresh weights. Structure and initialization are separate: the fields are plain,
        so `dataclasses.replace` / `eqx.tree_at` swap any of them without re-initializing."""
        keys = jax.random.split(key, cfg.n_layers + 2)
        n_dense = min(cfg.n_dense_layers, cfg.n_layers)
        return cls(
            embed=normal(keys[0], (cfg.vocab_size, cfg.d_model), cfg.init_std),
            dense_layers=stack_blocks(cfg, moe, True, keys[2:2 + n_dense]),
            moe_layers=stack_blocks(cfg, moe, False, keys[2 + n_dense:]),
            final_norm=RMSNorm.init(cfg.d_model, cfg.norm_eps),
            lm_head=None if cfg.tie_embeddings else normal(
                keys[1], (cfg.d_model, cfg.vocab_size), cfg.init_std),
            cfg=cfg,
        )

    def __call__(
        self,
        tokens: Int[Array, "B S"],
        caches: Caches | None = None,
        cache_index: Array | int = 0,
        segments: Int[Array, "B S"] | None = None,
        positions: Int[Array, "B S"] | None = None,
    ) -> tuple[Float[Array, "B S V"], MoEStats | None, Caches | None]:
        """Logits for every position, per-MoE-layer stats stacked [L_moe], updated caches.
        `segments` (training, no cache): attention stays within equal ids (`short_segments`).
        `positions`: RoPE positions (packed conversations restart at 0 in each segment);
        None = 0.. from cache_index."""
        x, stats, caches = self.hidden(tokens, caches, cache_index, segments, positions)
        return self.logits(x), stats, caches

    def hidden(
        self,
        tokens: Int[Array, "B S"],
        caches: Caches | None = None,
        cache_index: Array | int = 0,
        segments: Int[Array, "B S"] | None = None,
        positions: Int[Array, "B S"] | None = None,
    ) -> tuple[Float[Array, "B S D"], MoEStats | None, Caches | None]:
        """The last layer's output (before the final norm), as `__call__` otherwise."""
        with jax.named_scope("embed"):
            x = self.embed[tokens]
        cos, sin = self.angles(tokens.shape, cache_index, x.dtype, positions)
        dense_cache, moe_cache = caches if caches is not None else (None, None)
        x, _, dense_cache = self._run(self.dense_layers, x, cos, sin, dense_cache, cache_index,
                                      segments)
        x, stats, moe_cache = self._run(self.moe_layers, x, cos, sin, moe_cache, cache_index,
                                        segments)
        return x, stats, (dense_cache, moe_cache) if caches is not None else None

    def logits(self, x: Float[Array, "... D"], norm: RMSNorm | None = None) -> Array:
        """The output head: norm (the final norm by default) then W_out, in float32."""
        with jax.named_scope("head"):
            x = (norm or self.final_norm)(x)
            head = self.embed.T if self.lm_head is None else self.lm_head
            return linear(x, head).astype(jnp.float32)

    def angles(self, shape: tuple[int, int], cache_index: Array | int, dtype,
               positions: Array | None = None) -> tuple[Array, Array]:
        """RoPE's cos and sin [B, S, head_dim] for positions cache_index.. of a [B, S] batch
        (or the given positions [B, S]: packed conversations restart in each segment)."""
        b, s = shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s) + cache_index, (b, s))
        cos, sin = rope_angles(positions, self.cfg.resolved_head_dim, self.cfg.rope_theta,
                               self.cfg.rope)
        return cos.astype(dtype), sin.astype(dtype)

    def _run(self, stack: Block | None, x, cos, sin, cache: KVCache | None, cache_index,
             segments=None):
        """Run one stack of layers: scanned, or unrolled over the same stacked arrays."""
        if stack is None:
            return x, None, cache

        def layer(x, block_and_cache):
            block, cache = block_and_cache
            x, stats, cache = block(x, cos, sin, cache, cache_index, segments)
            return x, (stats, cache)

        layer = remat(layer, self.cfg.remat)
        if self.cfg.scan_layers:
            x, (stats, cache) = jax.lax.scan(layer, x, (stack, cache))
            return x, stats, cache
        outs = []
        for i in range(stack_depth(stack)):
            x, out = layer(x, layer_at((stack, cache), i))
            outs.append(out)
        stats, cache = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return x, stats, cache

    @property
    def blocks(self) -> list[Block]:
        """The layers one by one, dense prefix first (for export and inspection)."""
        return [layer_at(stack, i)
                for stack in (self.dense_layers, self.moe_layers) if stack is not None
                for i in range(stack_depth(stack))]

    def init_caches(self, batch: int, max_len: int, dtype=jnp.float32) -> Caches:
        c = self.cfg
        shape = (batch, max_len, c.n_kv_heads, c.resolved_head_dim)

        def cache(stack: Block | None) -> KVCache | None:
            if stack is None:
                return None
            n = stack_depth(stack)
            return KVCache(jnp.zeros((n, *shape), dtype), jnp.zeros((n, *shape), dtype))

        return cache(self.dense_layers), cache(self.moe_layers)


def with_model_config(model: Transformer, cfg: ModelConfig) -> Transformer:
    """The same arrays under another model config that shapes nothing: a stage's RoPE,
    attention-logit multiplier and attention implementation (config/plan.py's
    STAGE_MODEL_FIELDS). All are static fields (the model's cfg, each attention's
    logit_scale, impl, chunk), so a jitted step retraces for them."""
    scale = lambda node: (dataclasses.replace(
        node, logit_scale=cfg.attn_logit_scale, impl=cfg.attention_impl,
        chunk=cfg.attention_chunk) if isinstance(node, Attention) else node)
    model = jax.tree.map(scale, model, is_leaf=lambda node: isinstance(node, Attention))
    return dataclasses.replace(model, cfg=cfg)


def with_dropless_dispatch(model: Transformer, block_size: int | None = None) -> Transformer:
    """The same weights, routed with dropless dispatch (block_size: the CPU kernel's rows
    per block; None keeps the model's), without the training-only MTP modules."""
    model = dataclasses.replace(model, mtp=None)
    moe = next((b.ffn.moe for b in model.blocks if isinstance(b.ffn, MoE)), None)
    if moe is None:
        return model  # all layers dense
    moe = dataclasses.replace(moe, dispatch=DROPLESS.name, block_size=block_size or moe.block_size)
    skeleton = eqx.filter_eval_shape(Transformer.init, model.cfg, moe, jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


Caches = tuple[KVCache | None, KVCache | None]  # (dense prefix, MoE layers), stacked


def stack_blocks(cfg: ModelConfig, moe: MoEConfig, dense: bool, keys: Array) -> Block | None:
    """len(keys) blocks with every array stacked on a leading layer axis (None if none).
    Block i gets keys[i], so the weights equal those of building the blocks one by one."""
    if len(keys) == 0:
        return None
    return eqx.filter_vmap(lambda k: Block.init(cfg, moe, dense, k))(keys)


def stack_depth(stack: Block) -> int:
    return stack.attn.wq.shape[0]


def layer_at(stacked, i: int):
    """Layer i of a stacked pytree (arrays indexed on their leading axis)."""
    return jax.tree.map(lambda a: a[i], stacked)


def remat(layer, policy: str):
    """The layer function under the `model.remat` policy."""
    if policy == "none":
        return layer
    if policy == "full":
        return jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(
        layer, policy=jax.checkpoint_policies.save_only_these_names(*SAVE_MOE_NAMES))


def short_segments(batch: int, seq_len: int, short_rows: int, short_len: int) -> Array | None:
    """[batch, seq_len] segment ids that cut the first `short_rows` sequences into windows of
    `short_len` (data.short_rows / data.short_len); None when there are none."""
    if not short_rows:
        return None
    windows = jnp.arange(seq_len) // short_len + 1  # 1.. per window; a long row is all 0
    return jnp.where(jnp.arange(batch)[:, None] < short_rows, windows[None], 0)
