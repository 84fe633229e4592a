"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 sec. 2.2): `mtp.depth` modules.

Module k = 1..D at position i combines depth k-1's hidden state with the embedding of the
token k ahead, runs one transformer block and predicts the token k+1 ahead through the
model's output head (embedding and W_out shared with the model):

    h'_i^k = M_k [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))]        M_k: [2D, D]
    h^k = TRM_k(h'^k)                                  (causal attention over positions)
    P_{i+k+1}^k = softmax(OutHead(h_i^k))
    L = CE + mtp.loss_weight * mean_k CE_k       CE_k over the S-k positions that have t_{i+k+1}

h^0 is the model's last layer output (before its final norm). Where the paper leaves a
choice: TRM_k is a dense SwiGLU block (model.d_ff_dense wide, else d_ff * top_k: an MoE
layer's active FFN width), not an MoE layer, so MTP adds no router to balance and nothing
to the bias updates, expert loads or capacity; each module has its own RMSNorm before the
shared head, as in DeepSeek-V3's released weights (shared_head.norm).

The modules are stacked on a leading axis and run by `lax.scan` at the full length S:
module k reads the tokens shifted k ahead, and its last k positions (whose shifted tokens
wrap around) are left out of CE_k. Attention is causal, so those positions never reach the
kept ones, and the result equals the paper's loop over shrinking lengths (tests/test_mtp.py).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from moelab.config import Config, ModelConfig, MoEConfig
from moelab.model.layers import RMSNorm, linear, normal
from moelab.model.losses import token_cross_entropy
from moelab.model.transformer import Block, Transformer, remat

MTP_KEY = 0x6D7470  # folded into the run's init key for the MTP weights ("mtp")


class MTP(eqx.Module):
    """The D modules, each array stacked on a leading depth axis."""

    hidden_norm: RMSNorm  # RMSNorm(h^{k-1})
    embed_norm: RMSNorm  # RMSNorm(Emb(t_{i+k}))
    proj: Float[Array, "N D2 D"]  # M_k on the concatenation [h; e]
    block: Block  # TRM_k (dense)
    out_norm: RMSNorm  # before the shared output head

    @classmethod
    def init(cls, cfg: ModelConfig, moe: MoEConfig, depth: int, key: PRNGKeyArray) -> MTP:
        def one(key):
            kp, kb = jax.random.split(key)
            norm = lambda: RMSNorm.init(cfg.d_model, cfg.norm_eps)
            return cls(hidden_norm=norm(), embed_norm=norm(),
                       proj=normal(kp, (2 * cfg.d_model, cfg.d_model), cfg.init_std),
                       block=Block.init(cfg, moe, True, kb), out_norm=norm())

        return eqx.filter_vmap(one)(jax.random.split(key, depth))

    @property
    def depth(self) -> int:
        return self.proj.shape[0]

    def cross_entropy(
        self,
        model: Transformer,
        hidden: Float[Array, "B S D"],
        tokens: Int[Array, "B S"],
        targets: Int[Array, "B S"],
        segments: Int[Array, "B S"] | None = None,
    ) -> Float[Array, " N"]:
        """CE_k for k = 1..depth: `hidden` is the model's h^0 on `tokens`, whose next tokens
        are `targets` (targets[:, i] = t_{i+1})."""
        b, s = tokens.shape
        cos, sin = model.angles((b, s), 0, hidden.dtype)
        ahead = jnp.arange(1, self.depth + 1)
        shifted = lambda a: jnp.stack([jnp.roll(a, -k, axis=1) for k in range(1, self.depth + 1)])

        def module(h, xs):
            m, tokens_k, targets_k, k = xs  # tokens_k[:, i] = t_{i+k}, targets_k = t_{i+k+1}
            x = jnp.concatenate([m.hidden_norm(h), m.embed_norm(model.embed[tokens_k])], -1)
            h, _, _ = m.block(linear(x, m.proj), cos, sin, None, 0, segments)
            ce = token_cross_entropy(model.logits(h, m.out_norm), targets_k)[0]
            kept = jnp.arange(s) < s - k
            return h, jnp.sum(jnp.where(kept, ce, 0.0)) / (b * (s - k))

        _, ce = jax.lax.scan(remat(module, model.cfg.remat), hidden,
                             (self, shifted(tokens), shifted(targets), ahead))
        return ce


def init_model(cfg: Config, key: PRNGKeyArray) -> Transformer:
    """The model a run trains: `Transformer.init`'s weights (bitwise, from the same key)
    plus `cfg.mtp.depth` MTP modules from a key folded off it."""
    model = Transformer.init(cfg.model, cfg.moe, key)
    if not cfg.mtp.depth:
        return model
    mtp = MTP.init(cfg.model, cfg.moe, cfg.mtp.depth, jax.random.fold_in(key, MTP_KEY))
    return dataclasses.replace(model, mtp=mtp)
