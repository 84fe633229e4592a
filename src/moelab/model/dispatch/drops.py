"""What a dispatch could not deliver, counted where it happened."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int


class Drops(eqx.Module):
    """Assignment counts: cut by a sender's transport block, by an expert's capacity, and
    send-buffer rows that carried nothing (padding, the price of fixed-size exchanges)."""

    sender: Int[Array, ""]
    receiver: Int[Array, ""]
    padding: Int[Array, ""]

    @classmethod
    def at_expert(cls, dropped: Array) -> Drops:
        """Drops of a capacity cut at the expert, with nothing in transit."""
        zero = jnp.zeros((), jnp.int32)
        return cls(sender=zero, receiver=jnp.asarray(dropped, jnp.int32), padding=zero)

    @property
    def total(self) -> Array:
        """Assignments whose expert output is zero."""
        return self.sender + self.receiver
