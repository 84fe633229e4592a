"""The dispatch registry: every way to send routed tokens to their experts and back.

A dispatch is one `DispatchEntry`, registered by name (`moe.dispatch` picks it):

    local            its one-device form, (x [B, S, D], routing, experts, moe) -> (y, Drops),
                     which the MoE layer calls (the entry itself is callable as it)
    drops            whether it can drop assignments (capacity): generation, the golden
                     files and the export then route dropless, which never does
    check            its mesh checks, (Config) -> None raising ConfigError that names the
                     field; run by the trainer before anything is built (`check_dispatch`)
    expert_parallel  one device's part under `jax.shard_map` over the "expert" mesh axis,
                     (x, routing, experts, *, moe, ep, exchange) -> (y, Drops summed over
                     the mesh); the built-ins' are filled in by moelab.parallel.expert, so
                     this layer never imports parallel; None: mesh.expert must be 1

Nothing outside this module compares dispatch names, and the config checks `moe.dispatch`
through this registry (`config.register_check`); docs/dispatch.md shows how to add one: a
file of its own in this package, and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moelab.config import ConfigError, MoEConfig, register_check
from moelab.model.dispatch.capacity import capacity_dispatch, pooled_dispatch
from moelab.model.dispatch.dropless import dropless_dispatch
from moelab.model.dispatch.drops import Drops
from moelab.model.dispatch.experts import Experts
from moelab.model.dispatch.pooled_wave import pooled_wave_dispatch

if TYPE_CHECKING:
    from moelab.config import Config

Dispatch = Callable  # (x, routing, experts, moe) -> (y, Drops)


@dataclass(eq=False)
class DispatchEntry:
    name: str
    local: Dispatch
    drops: bool
    check: Callable[[Config], None] | None = None
    expert_parallel: Callable | None = None

    def __call__(self, x, routing, experts, moe):
        return self.local(x, routing, experts, moe)


DISPATCHES: dict[str, DispatchEntry] = {}


def register(entry: DispatchEntry) -> DispatchEntry:
    DISPATCHES[entry.name] = entry
    return entry


def entry_of(moe: MoEConfig) -> DispatchEntry:
    if moe.dispatch not in DISPATCHES:
        raise ConfigError(f"moe.dispatch: {moe.dispatch!r} is not one of {list(DISPATCHES)}")
    return DISPATCHES[moe.dispatch]


@register_check
def _check_name(cfg: Config) -> None:
    """moe.dispatch names a registered dispatch: run by every config validation once this
    module is imported (the config layer knows no dispatch names)."""
    entry_of(cfg.moe)


def get_dispatch(moe: MoEConfig) -> Dispatch:
    return entry_of(moe).local


def check_dispatch(cfg: Config) -> None:
    """The configured dispatch's mesh checks (ConfigError naming the field)."""
    entry = entry_of(cfg.moe)
    if entry.check is not None:
        entry.check(cfg)


def _shards(cfg: Config) -> tuple[int, int]:
    """(devices the batch splits over, sequences of a micro-batch)."""
    mesh = cfg.mesh
    return mesh.data * mesh.fsdp * mesh.expert, cfg.data.batch_size // cfg.optim.grad_accum


def _check_pooled(cfg: Config) -> None:
    """A pool is formed on one device: pool_size must divide the per-device batch."""
    shards, micro = _shards(cfg)
    pool = cfg.moe.pool_size
    if pool and shards > 1 and (micro // shards) % pool:
        raise ConfigError(f"moe.pool_size: {pool} must divide the per-device batch of "
                          f"{micro // shards} sequences")


def _check_pooled_wave(cfg: Config) -> None:
    if cfg.mesh.exchange == "ring":
        raise ConfigError("mesh.exchange: ring does not apply to moe.dispatch=pooled_wave (it "
                          "has its own all_to_all)")


CAPACITY = register(DispatchEntry("capacity", capacity_dispatch, drops=True))
POOLED = register(DispatchEntry("pooled", pooled_dispatch, drops=True, check=_check_pooled))
POOLED_WAVE = register(DispatchEntry("pooled_wave", pooled_wave_dispatch, drops=True,
                                     check=_check_pooled_wave))
DROPLESS = register(DispatchEntry("dropless", dropless_dispatch, drops=False))

# Every module of this package is imported, so a dispatch in a file of its own (ending in
# `register(DispatchEntry(...))`) is registered without another file naming it.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["CAPACITY", "DISPATCHES", "DROPLESS", "POOLED", "POOLED_WAVE", "DispatchEntry",
           "Drops", "Experts", "check_dispatch", "entry_of", "get_dispatch", "register"]
