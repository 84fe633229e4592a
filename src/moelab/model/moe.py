"""The mixture-of-experts feed-forward: route, dispatch to experts, combine, add shared.

    y = sum_k w_k(x) * expert_{e_k(x)}(x)  [+ shared(x)]

How tokens reach their experts (capacity, pooled, dropless, or an expert-parallel
exchange) is the `dispatch` function; this module only states the math around it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from moelab.config import ModelConfig, MoEConfig
from moelab.model.dispatch import Dispatch, Experts, get_dispatch
from moelab.model.layers import SwiGLU, normal
from moelab.model.router import route

# Names of the tensors that `model.remat: save_moe` keeps for the backward pass: the routing
# decision, the MoE output and, under expert parallelism, what each exchange delivered
# (moelab.parallel.expert), so neither routing nor any collective runs again.
EXCHANGE_IN, EXCHANGE_OUT = "moe_exchange_in", "moe_exchange_out"
SAVE_MOE_NAMES = ("moe_routing", "moe_out", EXCHANGE_IN, EXCHANGE_OUT)


class MoEStats(eqx.Module):
    """Per-layer routing statistics, logged every step."""

    aux_loss: Float[Array, ""]
    seq_aux_loss: Float[Array, ""]  # DeepSeek-V3 sequence-wise balance loss (unweighted)
    router_z: Float[Array, ""]
    drop_frac: Float[Array, ""]  # fraction of token-assignments dropped (sender + receiver)
    sender_drop_frac: Float[Array, ""]  # pooled_wave: cut by a sender's transport block
    padding_frac: Float[Array, ""]  # pooled_wave: empty send-buffer rows per assignment
    tokens_per_expert: Float[Array, " E"]
    router_entropy: Float[Array, ""]
    quantile_bias: Float[Array, " E"]  # moe.balance=bias_quantile: next step's bias


class MoE(eqx.Module):
    router: Float[Array, "D E"]
    experts: Experts
    shared: SwiGLU | None
    # Selection bias (moe.balance=bias_*), in score space; not trained: moelab.model.balance
    # updates it after each optimizer step and keeps it out of the optimizer.
    bias: Float[Array, " E"] | None
    moe: MoEConfig = eqx.field(static=True)
    dispatch: Dispatch = eqx.field(static=True)

    @classmethod
    def init(cls, cfg: ModelConfig, moe: MoEConfig, key: PRNGKeyArray) -> MoE:
        """Fresh weights; the fields stay plain, so `dataclasses.replace` swaps any of them."""
        kr, ke, ks = jax.random.split(key, 3)
        d_shared = moe.d_ff_shared or cfg.d_ff
        shared = SwiGLU.init(cfg.d_model, d_shared, cfg.init_std, ks) if moe.shared_expert else None
        return cls(
            router=normal(kr, (cfg.d_model, moe.n_experts), cfg.init_std),
            experts=Experts.init(moe.n_experts, cfg.d_model, cfg.d_ff, cfg.init_std, ke),
            shared=shared,
            bias=None if moe.balance == "aux_loss" else jnp.zeros(moe.n_experts, jnp.float32),
            moe=moe,
            dispatch=get_dispatch(moe),
        )

    def __call__(self, x: Float[Array, "B S D"]) -> tuple[Float[Array, "B S D"], MoEStats]:
        with jax.named_scope("router"):
            logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32),
                                self.router.astype(jnp.float32))
            routing, router_stats = route(logits, self.moe, self.bias)
        routing = checkpoint_name(routing, "moe_routing")
        with jax.named_scope("dispatch"):  # its expert matmuls are named "experts"
            y, dropped = self.dispatch(x, routing, self.experts, self.moe)
        y = checkpoint_name(y, "moe_out")
        if self.shared is not None:
            y = y + self.shared(x)
        stats = MoEStats(
            aux_loss=router_stats.aux_loss,
            seq_aux_loss=router_stats.seq_aux_loss,
            router_z=router_stats.router_z,
            drop_frac=dropped.total / routing.experts.size,
            sender_drop_frac=dropped.sender / routing.experts.size,
            padding_frac=dropped.padding / routing.experts.size,
            tokens_per_expert=router_stats.tokens_per_expert,
            router_entropy=router_stats.entropy,
            quantile_bias=router_stats.quantile_bias,
        )
        return y, stats
