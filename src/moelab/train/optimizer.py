"""AdamW (or Muon) with decoupled weight decay, a learning-rate schedule, and global-norm
clipping.

Warmup-stable-decay (WSD): linear warmup, a long constant phase, then a linear decay over
the last `decay_fraction` of steps. Unlike cosine, the stable phase can be cut at any
point and decayed, which is what a scaling ladder wants from its rungs.

`optim.name: muon` (Jordan et al. 2024; Moonlight, Liu et al. 2025) updates the hidden
matrices (attention projections, every SwiGLU matrix: routed experts, shared expert, dense
FFN) with optax's Muon: Nesterov momentum, then Newton-Schulz orthogonalisation of each
2-D matrix. The stacked arrays ([L, D, F], experts [L, E, D, F]) are batches of matrices:
the last two axes are (fan_in, fan_out), every leading axis a batch axis, so each expert's
matrix of each layer is orthogonalised on its own. The embedding, the output head, the
norm scales and the routers keep AdamW, as Moonlight and Kimi K2 do.

Width transfer (Moonlight's RMS matching): an orthogonalised [A, B] update has RMS
1/sqrt(max(A, B)); Muon's update is scaled by 0.2 sqrt(max(A, B)) so its RMS is 0.2,
AdamW's typical update RMS. Then AdamW's lr and weight decay serve Muon unchanged, at
every width of a ladder (so optim.lr_base_width, muP's Adam rule, is not combined with it).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from moelab.config import Config, OptimConfig
from moelab.config.plan import RestartConfig
from moelab.model.attention import Attention
from moelab.model.balance import without_bias
from moelab.model.dispatch.experts import Experts
from moelab.model.layers import RMSNorm, SwiGLU


def warmup_length(cfg: OptimConfig, total_steps: int) -> int:
    """The warmup actually used: `warmup_steps`, cut to leave at least one step after it."""
    return min(cfg.warmup_steps, max(total_steps - 1, 0))


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = warmup_length(cfg, total_steps)
    low = cfg.lr * cfg.min_lr_ratio
    after_warmup = max(total_steps - warmup, 1)
    if cfg.schedule == "cosine":
        tail = optax.cosine_decay_schedule(cfg.lr, after_warmup, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        tail = optax.linear_schedule(cfg.lr, low, after_warmup)
    elif cfg.schedule == "wsd":
        decay = max(int(round(cfg.decay_fraction * total_steps)), 0)
        stable = max(after_warmup - decay, 0)
        tail = optax.join_schedules(
            [optax.constant_schedule(cfg.lr), optax.linear_schedule(cfg.lr, low, max(decay, 1))],
            [stable],
        )
    else:
        tail = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return tail
    ramp = optax.linear_schedule(cfg.lr / max(warmup, 1), cfg.lr, warmup)
    return optax.join_schedules([ramp, tail], [warmup])


def restart_schedule(cfg: OptimConfig, restart: RestartConfig, length: int) -> optax.Schedule:
    """A stage's own schedule over its `length` steps: warmup to optim.lr * peak_fraction,
    then its decay to peak * min_lr_ratio (the stage's, else optim's) at its last step."""
    peak = cfg.lr * restart.peak_fraction
    ratio = cfg.min_lr_ratio if restart.min_lr_ratio is None else restart.min_lr_ratio
    after = max(length - restart.warmup, 1)
    if restart.decay == "linear":
        tail = optax.linear_schedule(peak, peak * ratio, after)
    elif restart.decay == "cosine":
        tail = optax.cosine_decay_schedule(peak, after, alpha=ratio)
    else:
        tail = optax.constant_schedule(peak)
    if not restart.warmup:
        return tail
    ramp = optax.linear_schedule(peak / restart.warmup, peak, restart.warmup)
    return optax.join_schedules([ramp, tail], [restart.warmup])


def run_schedule(cfg: Config) -> optax.Schedule:
    """The LR of every step of the run: `optim`'s schedule over `train.steps`, replaced from
    each stage with a `restart` by that stage's own schedule (`config/plan.py`)."""
    base = lr_schedule(cfg.optim, cfg.train.steps)
    segments = cfg.plan.lr_segments()
    if all(restart is None for _, _, restart in segments):
        return base
    parts = [(lambda step, a=a: base(step + a)) if restart is None  # join_schedules shifts
             else restart_schedule(cfg.optim, restart, b - a) for a, b, restart in segments]
    return optax.join_schedules(parts, [a for a, _, _ in segments[1:]])


def bias_rate_scale(cfg: Config, opt_state) -> jax.Array | float:
    """The factor on the selection bias's rate at this step (`moe.bias_rate_schedule`): 1, or
    after warmup lr(step) / optim.lr, so the bias stops chasing one batch's loads while the
    weights, which it balances, settle in the decay. `opt_state` is the state before the
    step's update: its schedule counter is the step's index."""
    if cfg.moe.bias_rate_schedule == "constant":
        return 1.0
    step = optax.tree.get(opt_state, "count", filtering=lambda path, _: getattr(  # the LR
        path[-1], "tuple_name", None) == "ScaleByScheduleState")  # schedule's own counter
    warmup = warmup_length(cfg.optim, cfg.train.steps)
    lr = run_schedule(cfg)(step) / cfg.optim.lr
    return jnp.where(step < warmup, 1.0, lr)


def _matrices(params, keep_embedding: bool = True):
    """True for weight matrices, False for norm scales and (unless keep_embedding) the
    embedding. Layers are stacked, so a norm scale is [L, D]: rank does not tell them apart,
    the RMSNorm module around them does."""
    mask = jax.tree.map(
        lambda x: jax.tree.map(lambda _: False, x) if isinstance(x, RMSNorm) else x.ndim >= 2,
        params, is_leaf=lambda x: isinstance(x, RMSNorm))
    if not keep_embedding:
        mask = eqx.tree_at(lambda m: m.embed, mask, False)
    return mask


def decay_mask(params):
    """Decay matrices only: norm scales are left alone, as is standard."""
    return _matrices(params)


def width_factor(cfg: OptimConfig, d_model: int) -> float:
    """The lr multiplier of the width-scaled matrices, (lr_base_width / d_model) **
    lr_width_power (`optim`), 1 when off."""
    return (cfg.lr_base_width / d_model) ** cfg.lr_width_power if cfg.lr_base_width else 1.0


MUON_RMS = 0.2  # Moonlight: Muon's update RMS matched to AdamW's, so lr and decay carry over
MUON, ADAM = "muon", "adam"


def muon_labels(params):
    """MUON for the hidden matrices (attention projections, SwiGLU matrices of experts,
    shared expert and dense FFN), ADAM for the rest (embedding, head, norms, routers)."""
    def label(node):
        if isinstance(node, SwiGLU | Experts):
            return jax.tree.map(lambda _: MUON, node)
        if isinstance(node, Attention):
            labels = jax.tree.map(lambda _: ADAM, node)  # its QK-norm scales
            return eqx.tree_at(lambda a: (a.wq, a.wk, a.wv, a.wo), labels, (MUON,) * 4)
        return ADAM

    return jax.tree.map(label, params,
                        is_leaf=lambda n: isinstance(n, SwiGLU | Experts | Attention))


def _matrix_axes(updates):
    """Muon's reshaping of every array it sees: (fan_in, fan_out) = the last two axes, all
    leading axes (layers, experts) batch axes orthogonalised one matrix at a time."""
    dims = optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
    return jax.tree.map(lambda _: dims, updates)


def rms_matched(update: jax.Array) -> jax.Array:
    """Moonlight's width-transfer rule: an orthogonalised [.., A, B] update times
    0.2 sqrt(max(A, B)), giving it AdamW's update RMS of about 0.2."""
    return update * (MUON_RMS * max(update.shape[-2:]) ** 0.5)


def muon(cfg: OptimConfig) -> optax.GradientTransformation:
    """Muon on the hidden matrices and Adam on the rest, before the shared lr (the weight
    decay is decoupled in both, lr * weight_decay * param, as in optax.adamw)."""
    return optax.multi_transform({
        MUON: optax.chain(
            optax.contrib.scale_by_muon(ns_steps=cfg.muon_ns_steps, beta=cfg.muon_momentum,
                                        weight_dimension_numbers=_matrix_axes),
            optax.stateless(lambda updates, _: jax.tree.map(rms_matched, updates)),
            optax.add_decayed_weights(cfg.weight_decay)),
        ADAM: optax.chain(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
                          optax.add_decayed_weights(cfg.weight_decay, decay_mask)),
    }, muon_labels)


def make_optimizer(cfg: OptimConfig, total_steps: int, params, d_model: int = 0,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
    """`d_model` sets the width-transfer factor when `optim.lr_base_width` is on: the AdamW
    update (weight decay included, as it is decoupled and scales with lr) of every matrix
    but the embedding is multiplied by `width_factor`. `schedule` replaces
    `optim`'s own (a staged run passes `run_schedule(cfg)`). `optim.name: muon` puts
    Muon in AdamW's place for the hidden matrices (`muon`), under the same schedule."""
    del params  # the masks are computed lazily from the params optax sees
    lr = schedule or lr_schedule(cfg, total_steps)
    if cfg.name == "muon":  # one lr scaling after both, so the state has one LR counter
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), muon(cfg),
                           optax.scale_by_learning_rate(lr))
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    parts = [optax.clip_by_global_norm(cfg.clip_norm), adamw]
    if cfg.lr_base_width:
        if d_model <= 0:
            raise ValueError("optim.lr_base_width needs the model's d_model")
        parts.append(optax.masked(optax.scale(width_factor(cfg, d_model)),
                                  lambda p: _matrices(p, keep_embedding=False)))
    return optax.chain(*parts)


def with_schedule_step(opt_state, step: int):
    """`opt_state` with the LR schedule's counter set to `step`: a fresh optimizer state
    mid-run (a stage with `optimizer: fresh`, a weights-only branch) starts its moments and
    Adam's bias correction at 0 but must read the run's LR at its real step."""
    is_schedule = lambda path, _: getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"
    count = optax.tree.get(opt_state, "count", filtering=is_schedule)
    # placed like the old counter, so the jitted step sees the same input layout
    return optax.tree.set(opt_state, is_schedule, count=jax.device_put(
        jnp.asarray(step, count.dtype), count.sharding))


def trainable(model):
    """The array leaves optax updates: not static fields, not the routers' selection bias
    (moved by its own rule after each step, so Adam state and weight decay never touch it)."""
    return without_bias(eqx.filter(model, eqx.is_array))
