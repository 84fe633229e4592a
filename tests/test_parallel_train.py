"""`moelab train --config configs/ep4.yaml` runs end to end, expert-parallel on 8 CPU devices.

The run's first loss (before any update) must equal the single-device loss of the same
model on the same batch: the expert-parallel model is the same function.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import fake_devices_env

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "ep4.yaml"


def test_moelab_train_with_expert_parallelism(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moelab.cli", "train", "--config", str(CONFIG), "--run-dir",
           str(run)]
    proc = subprocess.run(cmd, cwd=REPO, env=fake_devices_env(8), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    from moelab.config import load_config

    cfg = load_config(CONFIG)
    assert (cfg.mesh.data, cfg.mesh.expert) == (2, 4)
    assert [r["step"] for r in rows] == list(range(1, cfg.train.steps + 1))
    assert all(np.isfinite(r["loss"]) and r["drop_frac/layer_0"] == 0.0 for r in rows)
    assert any(k.startswith("val_loss/") for k in rows[-1])
    assert abs(rows[0]["loss"] - single_device_first_loss(cfg)) < 1e-5


def single_device_first_loss(cfg) -> float:
    """The loss of the initial model on the first training batch, on one device."""
    import equinox as eqx

    from moelab.config import data_dir, replace
    from moelab.data.loader import Loader
    from moelab.parallel.mesh import make_mesh
    from moelab.train.step import make_loss
    from moelab.train.trainer import build_model

    cfg = replace(cfg, mesh={"data": 1, "expert": 1}, data={"path": str(data_dir(cfg.data.path))})
    d = cfg.data
    batch = Loader(d.path, "train", d.seq_len, d.batch_size, d.mixture, d.seed).batch(0)
    model = build_model(cfg, make_mesh(cfg.mesh))
    return float(eqx.filter_jit(make_loss(cfg))(model, batch)[0])
