"""FSDP on 8 fake CPU devices: parameters and optimizer state sharded, born sharded,
checkpoints restored onto another mesh shape.

The jax work runs in one subprocess (this file run as a script) so that XLA_FLAGS is set
before jax is imported; the tests read its report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fake_devices_env, tiny_config


@pytest.fixture(scope="module")
def report(small_corpus, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("fsdp")
    done = subprocess.run([sys.executable, __file__, str(small_corpus), str(work)],
                          env=fake_devices_env(8), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fsdp_shards_params_and_optimizer_state(report):
    # fsdp 8 splits every array 8 ways except the few whose axes 8 divides none of (norm
    # scales of size 4 here): their share is small, so the bound is 1/8 plus a margin.
    assert report["bytes_per_device"]["fsdp8"] <= 0.15 * report["bytes_per_device"]["fsdp1"]
    assert report["born_sharded"]  # built under jit with out_shardings: no full copy


def test_fsdp_step_equals_single_device(report):
    # The same float32 math with the gradient reduced across shards in another order: the
    # first loss (before any update) differs only by reduction order, ~1e-7 relative.
    assert report["first_loss"]["fsdp4"] == pytest.approx(report["first_loss"]["single"],
                                                          rel=1e-6)
    assert report["step_compiles"] == 1


def test_checkpoint_resumes_onto_another_mesh_shape(report):
    assert report["restored_bitwise"]  # saved on fsdp 4, restored on data 2 x fsdp 2
    # The first step after the resume starts from bitwise-identical state on the same batch,
    # so its loss differs from the uninterrupted run only by reduction order.
    step = report["resume_step"] + 1
    assert report["resumed_losses"][str(step)] == pytest.approx(
        report["clean_losses"][str(step)], rel=1e-6)
    assert sorted(map(int, report["resumed_losses"])) == list(range(1, 13))


def bytes_on_device(tree, device) -> int:
    import equinox as eqx
    import jax

    return sum(s.data.nbytes for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
               for s in a.addressable_shards if s.device == device)


def main(data: Path, work: Path) -> None:
    import equinox as eqx
    import jax
    import numpy as np

    from moelab.config import config_from_dict
    from moelab.train.checkpoint import Checkpointer
    from moelab.train.trainer import Trainer

    def config(steps=12, **mesh):
        raw = tiny_config(data, data={"path": str(data), "seq_len": 32, "batch_size": 8},
                          train={"steps": steps, "checkpoint_every": 4, "keep_checkpoints": 5,
                                 "eval_every": 1000, "log_every": 1000}, mesh=mesh)
        return config_from_dict(raw)

    out: dict = {"bytes_per_device": {}, "first_loss": {}}
    for name, mesh in {"fsdp1": {}, "fsdp8": {"fsdp": 8}}.items():
        trainer = Trainer(config(**mesh), work / name)
        device = jax.devices()[0]
        out["bytes_per_device"][name] = (bytes_on_device(trainer.model, device)
                                         + bytes_on_device(trainer.opt_state, device))
        if name == "fsdp8":
            out["born_sharded"] = all(
                len(a.sharding.device_set) == 8
                for a in jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array)))

    def losses(run: Path) -> dict[str, float]:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {str(r["step"]): r["loss"] for r in rows}

    single = Trainer(config(steps=1), work / "single")
    single.run()
    clean = Trainer(config(fsdp=4), work / "clean")
    clean.run()
    out["step_compiles"] = clean.train_step.cache_size()
    out["first_loss"] = {"single": losses(work / "single")["1"],
                         "fsdp4": losses(work / "clean")["1"]}
    out["clean_losses"] = losses(work / "clean")

    # Resume onto data 2 x fsdp 2 from the fsdp-4 run's checkpoint at step 4.
    resumed = work / "resumed"
    shutil.copytree(work / "clean", resumed)
    for step in (8, 12):
        shutil.rmtree(resumed / "checkpoints" / str(step))
    other = Trainer(config(data=2, fsdp=2), resumed)
    saved = Checkpointer(work / "clean", 5).restore(4, clean.model, clean.opt_state,
                                                    config(fsdp=4))[:2]
    out["restored_bitwise"] = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(eqx.filter((other.model, other.opt_state), eqx.is_array)),
                        jax.tree.leaves(eqx.filter(saved, eqx.is_array)), strict=True))
    out["resume_step"] = other.step
    other.run()
    out["resumed_losses"] = losses(resumed)
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
