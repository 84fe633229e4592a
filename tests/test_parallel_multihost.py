"""Multi-host: two local processes on loopback form one 4-device mesh and take a step.

Each process fakes 2 CPU devices; `initialize_distributed` joins them from MOELAB_* env
vars; the mesh is data 2 x expert 2 over both processes' devices; one jitted
expert-parallel SGD step runs, and both processes must report the same loss, equal to a
single-device forward of the same model on the same batch.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from test_parallel_expert import fake_devices_env

from moelab.config import ConfigError, DistributedConfig
from moelab.parallel.distributed import Cluster, resolve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_form_one_mesh_and_agree():
    port, n = free_port(), 2
    procs = []
    for rank in range(n):
        env = fake_devices_env(2, MOELAB_COORDINATOR=f"127.0.0.1:{port}",
                               MOELAB_NUM_PROCESSES=str(n), MOELAB_PROCESS_ID=str(rank))
        procs.append(subprocess.Popen([sys.executable, __file__], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["devices"] for r in results] == [4, 4]
    assert [r["process"] for r in results] == [0, 1]
    assert results[0]["loss"] == results[1]["loss"]
    assert abs(results[0]["loss"] - results[0]["single_device_loss"]) < 1e-5
    assert results[0]["loss_after"] == results[1]["loss_after"] < results[0]["loss"]


def test_resolve_reads_config_then_env():
    env = {"MOELAB_COORDINATOR": "10.0.0.1:1234", "MOELAB_NUM_PROCESSES": "4",
           "MOELAB_PROCESS_ID": "3"}
    assert resolve(DistributedConfig(), {}) is None
    assert resolve(DistributedConfig(num_processes=1), env) is None
    assert resolve(DistributedConfig(), env) == Cluster("10.0.0.1:1234", 4, 3)
    assert resolve(DistributedConfig(process_id=0), env) == Cluster("10.0.0.1:1234", 4, 0)


@pytest.mark.parametrize("cfg,env,field", [
    (DistributedConfig(coordinator_address="h:1"), {}, "num_processes"),
    (DistributedConfig(num_processes=2, process_id=0), {}, "coordinator_address"),
    (DistributedConfig(), {"MOELAB_COORDINATOR": "h:1", "MOELAB_NUM_PROCESSES": "2"},
     "process_id"),
    (DistributedConfig("h:1", 2, 2), {}, "process_id"),
    (DistributedConfig(), {"MOELAB_NUM_PROCESSES": "two"}, "MOELAB_NUM_PROCESSES"),
])
def test_partial_settings_name_what_is_missing(cfg, env, field):
    with pytest.raises(ConfigError, match=field):
        resolve(cfg, env)


# --------------------------------------------------------------- subprocess worker


def main() -> None:
    import equinox as eqx
    import jax
    import numpy as np

    from moelab.config import LossConfig, MeshConfig, ModelConfig, MoEConfig
    from moelab.model import Transformer, objective
    from moelab.parallel.distributed import initialize_distributed
    from moelab.parallel.expert import expert_parallel
    from moelab.parallel.mesh import batch_sharding, make_mesh, place

    assert initialize_distributed(DistributedConfig())
    model = eqx.filter_jit(Transformer.init)(
        ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8),
        MoEConfig(n_experts=4, top_k=2, dispatch="capacity", block_size=4), jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 32, (8, 5)).astype(np.int32)

    def loss_fn(model, tokens):
        logits, stats, _ = model(tokens[:, :-1])
        return objective(logits, tokens[:, 1:], stats, LossConfig())[0]

    @eqx.filter_jit
    def step(model, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        return loss, eqx.apply_updates(model, jax.tree.map(lambda g: -0.5 * g, grads))

    single = float(eqx.filter_jit(loss_fn)(model, tokens))
    mesh = make_mesh(MeshConfig(data=2, expert=2))
    sharded = expert_parallel(place(model, mesh), mesh)
    batch = jax.device_put(tokens, batch_sharding(mesh))
    loss, sharded = step(sharded, batch)
    loss_after, _ = step(sharded, batch)
    print(json.dumps({"process": jax.process_index(), "devices": len(jax.devices()),
                      "loss": float(loss), "loss_after": float(loss_after),
                      "single_device_loss": single}))


if __name__ == "__main__":
    main()
