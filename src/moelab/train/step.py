"""The jitted train step (with optional gradient accumulation) and the eval step."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from moelab.config import Config
from moelab.model import objective
from moelab.model.balance import bias_range, update_bias
from moelab.train.optimizer import trainable


def cast_floats(model, dtype):
    """The model with float arrays in the compute dtype; f32 master weights stay outside."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)


def make_loss(cfg: Config):
    dtype = jnp.dtype(cfg.train.dtype)

    def loss(model, batch):
        logits, stats, _ = cast_floats(model, dtype)(batch[:, :-1])
        return objective(logits, batch[:, 1:], stats, cfg.loss)

    return loss


def make_train_step(cfg: Config, optimizer: optax.GradientTransformation):
    grad_fn = eqx.filter_value_and_grad(make_loss(cfg), has_aux=True)
    accum = cfg.optim.grad_accum

    def accumulated(model, batch):
        """Mean loss and grads over `accum` micro-batches, one at a time (less memory)."""
        micro = batch.reshape(accum, -1, batch.shape[-1])

        def body(carry, mb):
            (_, parts), grads = grad_fn(model, mb)
            return jax.tree.map(jnp.add, carry, (parts, grads)), None

        shapes = eqx.filter_eval_shape(grad_fn, model, micro[0])
        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (parts, grads), _ = jax.lax.scan(body, (zero[0][1], zero[1]), micro)
        return jax.tree.map(lambda a: a / accum, (parts, grads))

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        if accum == 1:
            (_, parts), grads = grad_fn(model, batch)
        else:
            parts, grads = accumulated(model, batch)
        updates, opt_state = optimizer.update(trainable(grads), opt_state, trainable(model))
        parts["grad_norm"] = optax.tree.norm(grads)
        model = update_bias(eqx.apply_updates(model, updates), parts, cfg.moe)
        parts["bias_range"] = bias_range(model)
        return model, opt_state, parts

    return train_step


def make_eval_step(cfg: Config):
    loss = make_loss(cfg)

    @eqx.filter_jit
    def eval_step(model, batch):
        return loss(model, batch)[1]["ce"]

    return eval_step
