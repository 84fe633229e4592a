"""Expert parallelism on 8 fake CPU devices equals the single-device path, values and grads.

The jax work runs in one subprocess (this file run as a script) so that
XLA_FLAGS=--xla_force_host_platform_device_count=8 is set before jax is imported; the
tests below read its per-case report.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import fake_devices_env

TOL = 1e-5
DEVICES = 8
LAYER_CASES = [(e, d) for e in (2, 4, 8) for d in ("capacity", "pooled", "dropless")]
RAGGED_CASES = [2, 4, 8]  # dropless through ragged_all_to_all (emulated: CPU lacks it)
RING_CASES = [(8, "capacity"), (4, "pooled"), (8, "dropless"), (2, "dropless")]
WAVE_CASES = [(8, 1), (4, 3)]  # (expert shards, waves); 8 / shards data shards
# the slab kernel on each device, on the rows each exchange delivers (with the ring, other
# devices' experts' rows ride with the first and last local expert: parallel/expert.py)
SLAB_CASES = [(2, "auto"), (8, "auto"), (8, "ring")]


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run([sys.executable, __file__], env=fake_devices_env(DEVICES),
                          capture_output=True, text=True, timeout=1200)  # a hang guard
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n_experts,dispatch", LAYER_CASES)
def test_moe_layer_matches_single_device(report, n_experts, dispatch):
    case = report[f"layer/{dispatch}/E{n_experts}"]
    assert case["forward"] < TOL and case["grads"] < TOL, case
    assert case["drop_frac"] == case["drop_frac_single"]
    if dispatch == "capacity":
        assert case["drop_frac"] > 0  # the psum'd drop count is exercised, not just zero


@pytest.mark.parametrize("n_experts,exchange", SLAB_CASES)
def test_slab_kernel_under_expert_parallelism_matches_single_device(report, n_experts,
                                                                   exchange):
    case = report[f"slab/{exchange}/E{n_experts}"]
    assert case["forward"] < TOL and case["grads"] < TOL, case


@pytest.mark.parametrize("n_experts", RAGGED_CASES)
def test_ragged_exchange_matches_single_device(report, n_experts):
    case = report[f"ragged/dropless/E{n_experts}"]
    assert case["forward"] < TOL and case["grads"] < TOL, case


@pytest.mark.parametrize("n_experts,dispatch", RING_CASES)
def test_ring_exchange_matches_single_device(report, n_experts, dispatch):
    case = report[f"ring/{dispatch}/E{n_experts}"]
    assert case["forward"] < TOL and case["grads"] < TOL, case
    assert case["drops"] == case["drops_single"]
    if dispatch == "capacity":
        assert case["drops"][0] > 0  # each expert group counts its drops once


@pytest.mark.parametrize("n_experts,waves", WAVE_CASES)
def test_pooled_wave_exchange_matches_the_rule_on_one_device(report, n_experts, waves):
    """The same rule simulated on one device over n_experts virtual senders per data group."""
    case = report[f"wave/E{n_experts}/waves{waves}"]
    assert case["forward"] < TOL and case["grads"] < TOL, case
    assert case["drops"] == case["drops_single"]
    total, sender, padding = case["drops"]
    assert 0 < sender < total and padding > 0  # sender and receiver drops both happen


def test_jitted_model_step_matches_single_device(report):
    """The trainer's composition: place, expert_parallel, filter_jit of value_and_grad."""
    case = report["model/dropless/E4"]
    assert case["forward"] < TOL and case["grads"] < TOL, case


@pytest.mark.parametrize("exchange", ["padded", "ring"])
def test_save_moe_backward_runs_no_exchange_again(report, exchange):
    """Under `model.remat: save_moe` the backward pass has exactly the collectives it has
    without remat (each exchange's transpose), while `full` recomputes the forward's."""
    counts = report[f"remat/{exchange}"]
    assert counts["save_moe"] == counts["none"], counts
    assert counts["full"] > counts["none"], counts  # the count can tell the two apart


def test_pool_size_zero_pools_the_local_batch(report):
    """Under EP, pool_size 0 pools each device's own sequences, not the global batch."""
    case = report["layer/pooled-0-vs-local/E4"]
    assert case["forward"] < TOL and case["grads"] < TOL, case
    assert case["drop_frac"] == case["drop_frac_single"]


# --------------------------------------------------------------- subprocess worker


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """ragged_all_to_all (one slice per peer) from all_gather, for a backend without it."""
    import jax
    import jax.numpy as jnp

    gather = lambda a: jax.lax.all_gather(a, axis_name)
    me = jax.lax.axis_index(axis_name)
    ops, starts = gather(operand), gather(input_offsets)[:, me]
    sizes, at = gather(send_sizes)[:, me], gather(output_offsets)[:, me]  # per source
    r = jnp.arange(output.shape[0])[:, None]
    inside = (r >= at) & (r < at + sizes)  # [M, src]
    src = jnp.argmax(inside, axis=1)
    row = jnp.clip(starts[src] + r[:, 0] - at[src], 0, operand.shape[0] - 1)
    return jnp.where(jnp.any(inside, axis=1)[:, None], ops[src, row], output)


def max_diff(a, b) -> float:
    import equinox as eqx
    import jax
    import numpy as np

    pairs = zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)),
                jax.tree.leaves(eqx.filter(b, eqx.is_array)), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def compare(fn, module, inputs, mesh, exchange="auto", parallel_module=None) -> dict:
    """Run `fn(module, inputs)` -> (value, (outputs, drop_frac)) plain and expert-parallel.

    `parallel_module` (default: `module`) is the one made expert-parallel.
    """
    import equinox as eqx
    import jax
    import numpy as np

    from moelab.parallel.expert import expert_parallel
    from moelab.parallel.mesh import batch_sharding, place

    step = eqx.filter_jit(eqx.filter_value_and_grad(fn, has_aux=True))
    (v0, (o0, d0)), g0 = step(module, inputs)
    sharded = expert_parallel(place(parallel_module or module, mesh), mesh, exchange)
    (v1, (o1, d1)), g1 = step(sharded, jax.device_put(inputs, batch_sharding(mesh)))
    return {"forward": max_diff((v0, o0), (v1, o1)), "grads": max_diff(g0, g1),
            "drop_frac": float(d1.sum()), "drop_frac_single": float(d0.sum()),
            "drops": np.asarray(d1).tolist(),
            "drops_single": np.asarray(d0).tolist()}


def layer_case(n_experts: int, dispatch: str, exchange: str = "auto", parallel_pool: int = 2,
               single_dispatch=None, **moe) -> dict:
    """`single_dispatch` (default: the layer's own) is the one-device path compared with."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from moelab.config import MeshConfig, ModelConfig, MoEConfig
    from moelab.model.moe import MoE
    from moelab.parallel.expert import with_dispatch
    from moelab.parallel.mesh import make_mesh

    make = lambda pool: eqx.filter_jit(MoE.init)(  # under jit: eager init compiles op by op
        ModelConfig(d_model=8, d_ff=8, init_std=0.5),
        MoEConfig(n_experts=n_experts, top_k=min(2, n_experts - 1), dispatch=dispatch,
                  capacity_factor=1.0, pool_size=pool, block_size=4, **moe),
        jax.random.key(n_experts))
    x = jax.random.normal(jax.random.key(1), (2 * DEVICES, 4, 8))  # 2 sequences per device
    probe = jax.random.normal(jax.random.key(2), x.shape)

    def fn(layer, x):
        y, stats = layer(x)
        drops = jnp.stack([stats.drop_frac, stats.sender_drop_frac, stats.padding_frac])
        return jnp.mean(y * probe), (y, drops)

    mesh = make_mesh(MeshConfig(data=DEVICES // n_experts, expert=n_experts))
    single = make(2)
    if single_dispatch is not None:
        single = with_dispatch(single, single_dispatch)
    return compare(fn, single, x, mesh, exchange, make(parallel_pool))


def wave_case(n_experts: int, waves: int) -> dict:
    """pooled_wave over the mesh vs. its one-device simulation, per data group."""
    from functools import partial

    from moelab.model.dispatch.pooled_wave import pooled_wave_dispatch

    groups = DEVICES // n_experts
    one = partial(pooled_wave_dispatch, shards=n_experts)
    return layer_case(n_experts, "pooled_wave", single_dispatch=partial(per_group, one, groups),
                      waves=waves)


def per_group(dispatch, groups, x, routing, experts, moe):
    """`dispatch` on each of `groups` consecutive slices of the batch; drops summed."""
    import jax
    import jax.numpy as jnp

    split = lambda a: jnp.split(a, groups)
    parts = [dispatch(xg, type(routing)(*rg), experts, moe)
             for xg, *rg in zip(split(x), split(routing.experts), split(routing.weights),
                                strict=True)]
    ys, drops = zip(*parts, strict=True)
    return jnp.concatenate(ys), jax.tree.map(lambda *a: sum(a), *drops)


def model_case() -> dict:
    import equinox as eqx
    import jax

    from moelab.config import LossConfig, MeshConfig, ModelConfig, MoEConfig
    from moelab.model import Transformer, objective
    from moelab.parallel.mesh import make_mesh

    model = eqx.filter_jit(Transformer.init)(
        ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8),
        MoEConfig(n_experts=4, top_k=2, block_size=4), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (DEVICES, 5), 0, 32)

    def fn(model, tokens):
        logits, stats, _ = model(tokens[:, :-1])
        # the sequence-wise aux loss is computed from the global routing, outside shard_map
        loss, parts = objective(logits, tokens[:, 1:], stats, LossConfig(seq_aux_weight=0.01))
        return loss, (loss, parts["drop_frac"][:, None])

    return compare(fn, model, tokens, make_mesh(MeshConfig(data=2, expert=4)))


def remat_collectives(exchange: str) -> dict:
    """Collectives in the lowered gradient of a one-layer model, per remat policy."""
    import dataclasses

    import equinox as eqx
    import jax

    from moelab.config import LossConfig, MeshConfig, ModelConfig, MoEConfig
    from moelab.model import Transformer, objective
    from moelab.parallel.expert import expert_parallel
    from moelab.parallel.mesh import batch_sharding, make_mesh, place

    mesh = make_mesh(MeshConfig(data=2, expert=4))
    tokens = jax.device_put(jax.random.randint(jax.random.key(1), (DEVICES, 5), 0, 32),
                            batch_sharding(mesh))
    base = ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8)
    counts = {}
    for policy in ("none", "full", "save_moe"):
        model = eqx.filter_jit(Transformer.init)(dataclasses.replace(base, remat=policy),
                                            MoEConfig(n_experts=4, top_k=2, block_size=4),
                                            jax.random.key(0))
        model = expert_parallel(place(model, mesh), mesh, exchange)

        def loss(model, tokens):
            logits, stats, _ = model(tokens[:, :-1])
            return objective(logits, tokens[:, 1:], stats, LossConfig())[0]

        text = eqx.filter_jit(eqx.filter_grad(loss)).lower(model, tokens).as_text()
        counts[policy] = sum(text.count(op) for op in (
            "stablehlo.all_to_all", "stablehlo.all_gather", "stablehlo.reduce_scatter"))
    return counts


def main() -> None:
    import jax

    out = {f"layer/{d}/E{e}": layer_case(e, d) for e, d in LAYER_CASES}
    out |= {f"slab/{x}/E{e}": layer_case(e, "dropless", x, dropless_impl="slab")
            for e, x in SLAB_CASES}
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    out |= {f"ragged/dropless/E{e}": layer_case(e, "dropless", "ragged") for e in RAGGED_CASES}
    out["layer/pooled-0-vs-local/E4"] = layer_case(4, "pooled", parallel_pool=0)
    out |= {f"ring/{d}/E{e}": layer_case(e, d, "ring") for e, d in RING_CASES}
    out |= {f"wave/E{e}/waves{w}": wave_case(e, w) for e, w in WAVE_CASES}
    out["model/dropless/E4"] = model_case()
    out |= {f"remat/{x}": remat_collectives(x) for x in ("padded", "ring")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
