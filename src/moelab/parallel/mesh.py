"""The device mesh and where each array lives on it.

Three axes: `data`, `fsdp` and `expert`. The batch is split over all three (every device
holds different sequences). Routed experts' weights are split over `expert`. Over `fsdp`
every parameter, and so its optimizer state, is split along its largest axis that the axis
size divides (ZeRO-3 / FSDP): XLA gathers a weight where a computation needs it whole and
reduce-scatters its gradient. Over `data` everything else is replicated. The model code
never sees this: the trainer places arrays with these specs, and builds them born sharded
(`init_sharded`) so no device ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moelab.config import ConfigError, MeshConfig
from moelab.model.dispatch import Experts

AXES = ("data", "fsdp", "expert")
BATCH = P(AXES)  # leading batch axis over every device
EXPERT = P("expert")  # one layer's routed expert weights [E, D_in, D_out], inside a layer


def make_mesh(cfg: MeshConfig) -> Mesh:
    """A data x fsdp x expert mesh over the first data*fsdp*expert devices."""
    needed, devices = cfg.data * cfg.fsdp * cfg.expert, jax.devices()
    if needed > len(devices):
        raise ConfigError(
            f"mesh: data x fsdp x expert = {needed} devices, but only {len(devices)} are "
            "visible; lower mesh.data/mesh.fsdp/mesh.expert (on CPU, XLA_FLAGS="
            "--xla_force_host_platform_device_count=N fakes N devices)"
        )
    grid = np.asarray(devices[:needed]).reshape(cfg.data, cfg.fsdp, cfg.expert)
    return Mesh(grid, AXES)


def array_spec(shape: tuple[int, ...], mesh: Mesh, expert: bool) -> P:
    """Routed expert weights are [..., E, D_in, D_out] (stacked layers add a leading layer
    axis), so their expert axis is the third from the end; the fsdp axis takes the largest
    remaining axis it divides (the last one on ties), and none if it divides none."""
    spec: list[str | None] = [None] * len(shape)
    if expert:
        spec[len(shape) - 3] = "expert"
    n = mesh.shape.get("fsdp", 1)
    free = [i for i in range(len(shape)) if spec[i] is None and shape[i] % n == 0]
    if n > 1 and free:
        spec[max(free, key=lambda i: (shape[i], i))] = "fsdp"
    return P(*spec)


def param_specs(tree, mesh: Mesh):
    """PartitionSpecs for a pytree of params (or optimizer state holding them)."""
    def spec_of(node):
        is_expert = isinstance(node, Experts)
        return jax.tree.map(lambda a: array_spec(a.shape, mesh, is_expert), node)

    return jax.tree.map(spec_of, tree, is_leaf=lambda n: isinstance(n, Experts))


def is_tensor(x) -> bool:
    """An array, or the shape of one."""
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct)


def shardings(tree, mesh: Mesh):
    """NamedShardings for the arrays (or shapes) of `tree`; None elsewhere."""
    arrays, _ = eqx.partition(tree, is_tensor)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(arrays, mesh))


def place(tree, mesh: Mesh):
    """Put every array of `tree` on the mesh with its spec (non-arrays pass through)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    placed = jax.tree.map(jax.device_put, arrays, shardings(arrays, mesh))
    return eqx.combine(placed, static)


def init_sharded(make: Callable, mesh: Mesh, *args):
    """`make(*args)` computed under jit with every output array born with its sharding:
    no device ever materializes more than its own shard of the result."""
    shapes = eqx.filter_eval_shape(make, *args)
    arrays, static = eqx.partition(shapes, is_tensor)
    build = lambda *a: eqx.filter(make(*a), eqx.is_array)
    built = jax.jit(build, out_shardings=shardings(arrays, mesh))(*args)
    return eqx.combine(built, static)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH)
