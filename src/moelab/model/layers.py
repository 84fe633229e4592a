"""Small building blocks: RMSNorm, rotary position embeddings, the SwiGLU feed-forward.

Conventions follow Qwen3 / Llama (rotate-half RoPE, weight-scaled RMSNorm) so that a
trained model exports to Hugging Face `transformers` without re-deriving any math.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from moelab.config import RopeConfig
from moelab.model.rope import rope_parameters


def normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.normal(key, shape, dtype=jnp.float32)


def linear(x: Float[Array, "... D"], w: Float[Array, "D F"]) -> Float[Array, "... F"]:
    """x @ w with the leading axes flattened into one token axis first: XLA:CPU runs the 2-D
    matmul ~1.7x faster than the same product on a [B, S, D] input (measured, 2 cores)."""
    flat = x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype)
    return flat.reshape(*x.shape[:-1], w.shape[-1])


class RMSNorm(eqx.Module):
    """x / rms(x) * weight, computed in float32 whatever the compute dtype."""

    weight: Float[Array, " D"]
    eps: float = eqx.field(static=True)

    @classmethod
    def init(cls, dim: int, eps: float) -> RMSNorm:
        return cls(weight=jnp.ones((dim,), jnp.float32), eps=eps)

    @jax.named_scope("norm")
    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight).astype(x.dtype)


def rope_angles(positions: Array, head_dim: int, theta: float,
                rope: RopeConfig | None = None) -> tuple[Array, Array]:
    """cos and sin of shape [*positions.shape, head_dim] for rotate-half RoPE, with the
    frequencies and cos/sin multiplier of `rope`'s scaling type (plain RoPE if None)."""
    inv_freq, scale = rope_parameters(head_dim, theta, rope or RopeConfig())
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: Float[Array, "B S H K"], cos: Array, sin: Array) -> Float[Array, "B S H K"]:
    """Rotate each (x1, x2) half-pair of a head by its position's angle."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    return (x * cos + rotated * sin).astype(x.dtype)


class SwiGLU(eqx.Module):
    """Dense feed-forward: down(silu(x @ gate) * (x @ up))."""

    w_gate: Float[Array, "D F"]
    w_up: Float[Array, "D F"]
    w_down: Float[Array, "F D"]

    @classmethod
    def init(cls, d_model: int, d_ff: int, std: float, key: PRNGKeyArray) -> SwiGLU:
        k1, k2, k3 = jax.random.split(key, 3)
        return cls(w_gate=normal(k1, (d_model, d_ff), std), w_up=normal(k2, (d_model, d_ff), std),
                   w_down=normal(k3, (d_ff, d_model), std))

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        hidden = jax.nn.silu(linear(x, self.w_gate)) * linear(x, self.w_up)
        return linear(hidden, self.w_down)
