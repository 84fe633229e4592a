"""The jitted train step (with optional gradient accumulation) and the eval step.

The step is a plain `jax.jit` over the model's arrays with the params and optimizer state
donated, so XLA updates them in place and the call returns as soon as the work is queued:
the host can prepare the next batch while the device computes. (equinox's `filter_jit`
blocks until every call finishes, which would serialize host and device.) The module's
static structure is a hashable static argument, split off and put back around the call.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from moelab.config import Config
from moelab.model import objective
from moelab.model.balance import bias_range, update_bias, with_biases_of
from moelab.model.transformer import short_segments
from moelab.train.optimizer import bias_rate_scale, trainable


def cast_floats(model, dtype):
    """The model with float arrays in the compute dtype; f32 master weights stay outside.
    The routers' selection biases stay float32: their steps (rate ~1e-3 on scores near 0.5)
    are below bfloat16's resolution there and would vanish from the choice."""
    cast = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)
    return with_biases_of(model, cast)


def make_loss(cfg: Config):
    dtype = jnp.dtype(cfg.train.dtype)

    def loss(model, batch, segments=None):
        tokens, packed = batch_parts(batch)
        if packed is not None:
            segments, positions, mask = packed
        else:
            positions = mask = None
        model = cast_floats(model, dtype)
        hidden, stats, _ = model.hidden(tokens[:, :-1], segments=segments, positions=positions)
        logits, mtp_ce = model.logits(hidden), None
        if model.mtp is not None:  # multi-token prediction (model/mtp.py)
            with jax.named_scope("mtp"):
                mtp_ce = model.mtp.cross_entropy(model, hidden, tokens[:, :-1], tokens[:, 1:],
                                                 segments)
        with jax.named_scope("loss"):
            return objective(logits, tokens[:, 1:], stats, cfg.loss, mtp_ce,
                             cfg.mtp.loss_weight, loss_mask=mask)

    return loss


def batch_parts(batch) -> tuple:
    """(tokens [B, S+1], None) of a batch of token windows, or (tokens, (segments,
    positions, loss mask)) of packed rows (`data.chat.Packed.batch`: a dict), each cut to
    the inputs [B, S] (segments, positions) or the targets (mask) it applies to."""
    if not isinstance(batch, dict):
        return batch, None
    return batch["tokens"], (batch["segments"][:, :-1], batch["positions"][:, :-1],
                             batch["loss_mask"][:, 1:])


def make_train_step(cfg: Config, optimizer: optax.GradientTransformation, donate: bool = True):
    grad_fn = eqx.filter_value_and_grad(make_loss(cfg), has_aux=True)
    accum, d = cfg.optim.grad_accum, cfg.data

    def accumulated(model, batch, segments):
        """Mean loss and grads over `accum` micro-batches, one at a time (less memory)."""
        micro = jax.tree.map(lambda a: a.reshape(accum, -1, a.shape[-1]), batch)
        if segments is not None:
            segments = segments.reshape(accum, -1, segments.shape[-1])

        def body(carry, mb_segments):
            (_, parts), grads = grad_fn(model, *mb_segments)
            return jax.tree.map(jnp.add, carry, (parts, grads)), None

        shapes = eqx.filter_eval_shape(grad_fn, model, jax.tree.map(lambda a: a[0], micro))
        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (parts, grads), _ = jax.lax.scan(body, (zero[0][1], zero[1]), (micro, segments))
        return jax.tree.map(lambda a: a / accum, (parts, grads))

    def step(params, static, opt_state, batch):
        model = eqx.combine(params, static)
        tokens = batch_parts(batch)[0]
        segments = short_segments(tokens.shape[0], tokens.shape[1] - 1, d.short_rows,
                                  d.short_len)
        if accum == 1:
            (_, parts), grads = grad_fn(model, batch, segments)
        else:
            parts, grads = accumulated(model, batch, segments)
        with jax.named_scope("optimizer"):
            scale = bias_rate_scale(cfg, opt_state)
            updates, opt_state = optimizer.update(trainable(grads), opt_state, trainable(model))
            parts["grad_norm"] = optax.tree.norm(grads)
            model = update_bias(eqx.apply_updates(model, updates), parts, cfg.moe, scale)
            parts["bias_range"] = bias_range(model)
        return eqx.filter(model, eqx.is_array), opt_state, parts

    return TrainStep(step, donate)


class TrainStep:
    """step(model, opt_state, batch) -> (new model, new opt_state, loss parts).

    With donation the inputs are consumed. The new params and optimizer state are pinned to
    the shardings of the first call's inputs, so the output of step N is laid out exactly as
    the input of step N+1 wants and the step compiles once (under FSDP XLA would otherwise
    pick its own output layout and compile a second variant).
    """

    def __init__(self, step, donate: bool):
        self._step, self._donate, self._jitted = step, donate, None

    def _jit(self, params, opt_state):
        if self._jitted is None:
            layout = jax.tree.map(lambda a: a.sharding, (params, opt_state))
            # Only a multi-device layout needs pinning; on one device out_shardings costs a
            # lot (tiny preset on 2 CPU cores: 638 vs 283 ms a step, measured side by side).
            many = any(len(s.device_set) > 1 for s in jax.tree.leaves(layout))
            pinned = {"out_shardings": (*layout, None)} if many else {}
            self._jitted = jax.jit(self._step, static_argnums=1,
                                   donate_argnums=(0, 2) if self._donate else (), **pinned)
        return self._jitted

    def __call__(self, model, opt_state, batch):
        params, static = eqx.partition(model, eqx.is_array)
        params, opt_state, parts = self._jit(params, opt_state)(params, static, opt_state, batch)
        return eqx.combine(params, static), opt_state, parts

    def lower(self, model, opt_state, batch):
        """The lowered step, for timing compilation (bench/train_step.py)."""
        params, static = eqx.partition(model, eqx.is_array)
        return self._jit(params, opt_state).lower(params, static, opt_state, batch)

    def cache_size(self) -> int:
        """Compiled variants so far: 1 in a healthy run."""
        return 0 if self._jitted is None else self._jitted._cache_size()


def make_eval_step(cfg: Config):
    """eval_step(model, batch) -> mean cross-entropy, asynchronous like the train step.
    The model is evaluated as it is served: without its MTP modules."""
    loss = make_loss(cfg)
    jitted = jax.jit(lambda params, static, batch: loss(eqx.combine(params, static), batch)[1][
        "ce"], static_argnums=1)

    def eval_step(model, batch):
        params, static = eqx.partition(dataclasses.replace(model, mtp=None), eqx.is_array)
        return jitted(params, static, batch)

    return eval_step
