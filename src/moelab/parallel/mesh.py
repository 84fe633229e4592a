"""The device mesh and where each array lives on it.

Two axes: `data` and `expert`. The batch is split over both (every device holds different
sequences); routed experts' weights are split over `expert`; everything else is
replicated. The model code never sees this: the trainer places arrays with these specs.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moelab.config import ConfigError, MeshConfig
from moelab.model.dispatch import Experts

BATCH = P(("data", "expert"))  # leading batch axis over every device
EXPERT = P("expert")  # leading expert axis of routed expert weights


def make_mesh(cfg: MeshConfig) -> Mesh:
    """A data x expert mesh over the first data*expert devices."""
    needed, devices = cfg.data * cfg.expert, jax.devices()
    if needed > len(devices):
        raise ConfigError(
            f"mesh: data x expert = {needed} devices, but only {len(devices)} are visible; "
            "lower mesh.data/mesh.expert (on CPU, XLA_FLAGS="
            "--xla_force_host_platform_device_count=N fakes N devices)"
        )
    grid = np.asarray(devices[:needed]).reshape(cfg.data, cfg.expert)
    return Mesh(grid, ("data", "expert"))


def param_specs(tree):
    """PartitionSpecs for a pytree of params (or optimizer state holding them)."""
    def spec_of(node):
        if isinstance(node, Experts):
            return jax.tree.map(lambda _: EXPERT, node)
        return jax.tree.map(lambda _: P(), node)

    return jax.tree.map(spec_of, tree, is_leaf=lambda n: isinstance(n, Experts))


def place(tree, mesh: Mesh):
    """Put every array of `tree` on the mesh with its spec (non-arrays pass through)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    specs = param_specs(arrays)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), arrays, specs)
    return eqx.combine(placed, static)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH)
