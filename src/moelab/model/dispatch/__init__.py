"""Ways to send routed tokens to their experts and back, selected by `moe.dispatch`.

Every dispatch has the same signature,
    dispatch(x [B, S, D], routing, experts, moe) -> (y [B, S, D], Drops)
so the MoE layer (and the expert-parallel wrapper) can swap one for another.
"""

from __future__ import annotations

from collections.abc import Callable

from moelab.config import MoEConfig
from moelab.model.dispatch.capacity import capacity_dispatch, pooled_dispatch
from moelab.model.dispatch.dropless import dropless_dispatch
from moelab.model.dispatch.drops import Drops
from moelab.model.dispatch.experts import Experts
from moelab.model.dispatch.pooled_wave import pooled_wave_dispatch

Dispatch = Callable  # (x, routing, experts, moe) -> (y, Drops)

DISPATCHES: dict[str, Dispatch] = {
    "capacity": capacity_dispatch,
    "pooled": pooled_dispatch,
    "pooled_wave": pooled_wave_dispatch,
    "dropless": dropless_dispatch,
}


def get_dispatch(moe: MoEConfig) -> Dispatch:
    return DISPATCHES[moe.dispatch]


__all__ = ["DISPATCHES", "Drops", "Experts", "get_dispatch"]
