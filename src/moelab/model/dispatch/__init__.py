"""Ways to send routed tokens to their experts and back, selected by `moe.dispatch`.

Every dispatch has the same signature,
    dispatch(x [B, S, D], routing, experts, moe) -> (y [B, S, D], dropped assignments)
so the MoE layer (and the expert-parallel wrapper) can swap one for another.
"""

from __future__ import annotations

from collections.abc import Callable

from moelab.config import MoEConfig
from moelab.model.dispatch.capacity import capacity_dispatch, pooled_dispatch
from moelab.model.dispatch.dropless import dropless_dispatch
from moelab.model.dispatch.experts import Experts

Dispatch = Callable  # (x, routing, experts, moe) -> (y, dropped)

DISPATCHES: dict[str, Dispatch] = {
    "capacity": capacity_dispatch,
    "pooled": pooled_dispatch,
    "dropless": dropless_dispatch,
}


def get_dispatch(moe: MoEConfig) -> Dispatch:
    return DISPATCHES[moe.dispatch]


__all__ = ["DISPATCHES", "Experts", "get_dispatch"]
