"""The routed experts' weights and the SwiGLU they compute, batched over experts."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from moelab.model.layers import normal


class Experts(eqx.Module):
    """E independent SwiGLU feed-forwards stacked on a leading expert axis."""

    w_gate: Float[Array, "E D F"]
    w_up: Float[Array, "E D F"]
    w_down: Float[Array, "E F D"]

    @classmethod
    def init(cls, n_experts: int, d_model: int, d_ff: int, std: float, key: PRNGKeyArray
             ) -> Experts:
        k1, k2, k3 = jax.random.split(key, 3)
        return cls(w_gate=normal(k1, (n_experts, d_model, d_ff), std),
                   w_up=normal(k2, (n_experts, d_model, d_ff), std),
                   w_down=normal(k3, (n_experts, d_ff, d_model), std))

    @property
    def n_experts(self) -> int:
        return self.w_gate.shape[0]

    def __call__(self, x: Float[Array, "E N D"]) -> Float[Array, "E N D"]:
        """Expert e applied to its own rows x[e]."""
        gate = jnp.einsum("end,edf->enf", x, self.w_gate)
        up = jnp.einsum("end,edf->enf", x, self.w_up)
        return jnp.einsum("enf,efd->end", jax.nn.silu(gate) * up, self.w_down)

    def take(self, index: Array) -> Experts:
        """The experts at `index` (repeats allowed): weights for per-block matmuls."""
        return jax.tree.map(lambda w: w[index], self)
