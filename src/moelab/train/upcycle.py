"""`moelab upcycle DENSE_RUN --experts E --top-k K --out RUN_DIR`: a new MoE run whose
step-0 checkpoint is the dense run's model upcycled (moelab.model.upcycle).

The new run's config is the dense run's with every layer sparse: model.n_dense_layers 0,
model.d_ff the dense FFN's width (each expert a full copy, so a token's FFN compute is
top_k times the dense one's), moe.n_experts / moe.top_k as given, then any --set. It
starts at step 0 with a fresh optimizer state and its own LR schedule (the shapes are
new); lineage.json names the dense run and step, as a `--from` branch's does, and an
`upcycle` event says the same. `moelab train RUN_DIR` (its own config.yaml) then trains
it as any run that resumes from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from moelab.config import config_from_dict, config_to_dict, load_config, set_dotted
from moelab.errors import UserError
from moelab.model import Transformer
from moelab.model.upcycle import dense_width, upcycle, upcycled_config
from moelab.train.checkpoint import load_latest
from moelab.train.rundir import (
    CONFIG_FILE,
    LAB_RUN_FILE,
    LINEAGE_FILE,
    RunDirLock,
    current_config_path,
)
from moelab.train.trainer import Trainer


def upcycle_run(dense_run: Path, out: Path, experts: int, top_k: int, step: int | None = None,
                noise: float = 0.01, seed: int = 0, overrides: dict[str, Any] | None = None
                ) -> Path:
    """Write the upcycled run to `out` (a new directory); returns its config file."""
    dense_run, out = Path(dense_run), Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; upcycle into a new run directory")
    dense, _, step = load_latest(dense_run, step)
    cfg = load_config(current_config_path(dense_run))
    m = cfg.model
    if m.n_dense_layers != m.n_layers:
        raise UserError(f"{dense_run}: its model has {m.n_layers - m.n_dense_layers} MoE layers; "
                        "upcycle takes a dense run (model.n_dense_layers = model.n_layers)")
    raw = config_to_dict(cfg)
    raw["model"] = dataclasses.asdict(upcycled_config(m, dense_width(dense)))
    raw["moe"].update(n_experts=experts, top_k=top_k)
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    new = config_from_dict(raw)
    if (new.model.d_ff != dense_width(dense) or new.moe.shared_expert
            or new.model.n_dense_layers):
        raise UserError("upcycle: every expert is a copy of the dense FFN "
                        f"(model.d_ff={dense_width(dense)}, moe.shared_expert=false, "
                        "model.n_dense_layers=0); do not --set them")
    model = upcycle(dense, new.model, new.moe, jax.random.key(seed), noise)
    like = jax.eval_shape(lambda: Transformer.init(new.model, new.moe, jax.random.key(seed)))
    leaves = zip(jax.tree.leaves(model), jax.tree.leaves(like), strict=False)
    if (jax.tree.structure(model) != jax.tree.structure(like)
            or any(a.shape != b.shape for a, b in leaves)):
        # before anything is written: the checkpoint would not load with its own config
        base = upcycled_config(m, dense_width(dense))
        changed = [f"model.{f.name}" for f in dataclasses.fields(base)
                   if getattr(base, f.name) != getattr(new.model, f.name)]
        raise UserError(f"upcycle: --set {', '.join(changed) or 'of a model field'} changes the "
                        "shape of weights copied from the dense run; set only fields that "
                        "keep them (the new run's moe.*, train.*, optim.*)")
    with RunDirLock(out):
        trainer = Trainer(new, out)
        trainer.model = jax.tree.map(lambda a, like: jax.device_put(a, like.sharding),
                                     model, trainer.model)
        trainer.save()
        source = dense_run.absolute()
        lab_run = (json.loads((source / LAB_RUN_FILE).read_text())["run_id"]
                   if (source / LAB_RUN_FILE).exists() else None)
        lineage = {"parent_run_dir": str(source), "step": step, "parent_lab_run": lab_run,
                   "optimizer_state": "fresh",
                   "upcycled": {"experts": experts, "top_k": top_k, "noise": noise,
                                "seed": seed}}
        (out / LINEAGE_FILE).write_text(json.dumps(lineage))
        trainer.log.event(0, "upcycle", f"upcycled from {source}@{step} (lab run {lab_run}): "
                          f"{experts} experts, top-{top_k}, each a copy of the dense FFN with "
                          f"noise {noise}")
    return out / CONFIG_FILE
