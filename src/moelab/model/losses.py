"""The training objective: cross-entropy plus three weighted regularizers, each logged.

    total = CE + aux_weight * mean_l(aux_l) + router_z_weight * mean_l(z_l)
               + logit_z_weight * mean_t logsumexp(logits_t)^2
               [+ seq_aux_weight * mean_l(seq_aux_l)]   (only when the weight is not 0)
               [+ mtp.loss_weight * mean_k(mtp_loss_k)]  (only with MTP modules)

The logit z-loss keeps the output softmax's log-normalizer near zero; without it the
gradient norm grew steadily in long ladder runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moelab.config import LossConfig
from moelab.model.moe import MoEStats

MTP_LOSS_PREFIX = "mtp_loss_"  # mtp_loss_1, mtp_loss_2, ...: CE of each MTP depth


def token_cross_entropy(
    logits: Float[Array, "B S V"], targets: Int[Array, "B S"]
) -> tuple[Array, Array]:
    """Each position's cross-entropy and log-normalizer [B, S] (float32)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - target_logit, lse


def cross_entropy_terms(
    logits: Float[Array, "B S V"], targets: Int[Array, "B S"],
    weights: Float[Array, "B S"] | None = None,
) -> tuple[Array, Array]:
    """Mean next-token cross-entropy and mean squared log-normalizer (float32), over the
    targets whose weight is 1 when `weights` is given (a loss mask: assistant tokens)."""
    ce, lse = token_cross_entropy(logits, targets)
    if weights is None:
        return jnp.mean(ce), jnp.mean(lse**2)
    weights = weights.astype(jnp.float32)
    total = jnp.maximum(weights.sum(), 1.0)  # a batch with no masked-in target: loss 0
    return (ce * weights).sum() / total, (lse**2 * weights).sum() / total


def objective(
    logits: Float[Array, "B S V"],
    targets: Int[Array, "B S"],
    stats: MoEStats | None,
    weights: LossConfig,
    mtp_ce: Float[Array, " N"] | None = None,
    mtp_weight: float = 0.0,
    loss_mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Total loss and its parts; per-layer MoE stats are kept for logging. `mtp_ce`: the
    cross-entropy of each multi-token-prediction depth (model/mtp.py), of which
    mtp_weight * mean is added (mtp.loss_weight). loss_mask [B, S]: only those targets
    count in the cross-entropy and logit z-loss (None: all)."""
    ce, logit_z = cross_entropy_terms(logits, targets, loss_mask)
    aux = jnp.mean(stats.aux_loss) if stats is not None else jnp.zeros(())
    seq_aux = jnp.mean(stats.seq_aux_loss) if stats is not None else jnp.zeros(())
    router_z = jnp.mean(stats.router_z) if stats is not None else jnp.zeros(())
    total = (ce + weights.aux_weight * aux + weights.router_z_weight * router_z
             + weights.logit_z_weight * logit_z)
    if weights.seq_aux_weight:  # skipped at 0, so the default objective is bitwise unchanged
        total = total + weights.seq_aux_weight * seq_aux
    if mtp_ce is not None:
        total = total + mtp_weight * jnp.mean(mtp_ce)
    parts = {"loss": total, "ce": ce, "aux_loss": aux, "seq_aux_loss": seq_aux,
             "router_z": router_z, "logit_z": logit_z}
    if mtp_ce is not None:
        parts.update({f"{MTP_LOSS_PREFIX}{k + 1}": mtp_ce[k] for k in range(mtp_ce.shape[0])})
    if stats is not None:
        parts["drop_frac"] = stats.drop_frac  # [L_moe]
        parts["tokens_per_expert"] = stats.tokens_per_expert  # [L_moe, E]
        parts["router_entropy"] = stats.router_entropy  # [L_moe]
        parts["sender_drop_frac"] = stats.sender_drop_frac  # [L_moe]
        parts["padding_frac"] = stats.padding_frac  # [L_moe]
        parts["quantile_bias"] = stats.quantile_bias  # [L_moe, E]
    return total, parts
