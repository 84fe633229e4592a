"""Orbax checkpoints of params, optimizer state and run state (loader, detectors, RNG).

Orbax writes each step into a temporary directory and renames it only once complete, so
a process killed mid-save leaves no checkpoint that would load wrong; the previous one
stays the latest. Arrays are saved as flat leaf lists: the pytree structure comes from
the config, which is stored beside them and checked before anything is restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from moelab.config import Config, config_from_dict, config_to_dict
from moelab.errors import UserError

# Fields whose change alters parameter shapes: a checkpoint is only loadable if they match.
SHAPE_FIELDS = {
    "model": ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "n_dense_layers", "d_ff_dense", "qk_norm", "tie_embeddings"],
    "moe": ["n_experts", "top_k", "shared_expert", "d_ff_shared"],
}


def is_tensor(x) -> bool:
    """An array, or the shape of one (templates for restore need no values)."""
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct)


def shape_mismatches(saved: dict, cfg: Config) -> list[str]:
    now = config_to_dict(cfg)
    return [f"{section}.{name}: checkpoint {saved[section].get(name)!r}, "
            f"config {now[section][name]!r}"
            for section, names in SHAPE_FIELDS.items() for name in names
            if saved.get(section, {}).get(name) != now[section][name]]


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints",
                                             options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model, opt_state, run_state: dict[str, Any]) -> None:
        arrays = {"params": jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                  "opt": jax.tree.leaves(opt_state)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(run_state)))
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"]

    def restore(self, step: int, model, opt_state, cfg: Config):
        """(model, opt_state, run_state) at `step`, laid out like the given templates."""
        meta = self.read_meta(step)
        mismatches = shape_mismatches(meta["config"], cfg)
        if mismatches:
            raise UserError(
                f"checkpoint {step} in {self.manager.directory} was written by an incompatible "
                f"config ({'; '.join(mismatches)}); use a new --run-dir or the original config")
        params, static = eqx.partition(model, is_tensor)
        templates = {"params": jax.tree.leaves(params), "opt": jax.tree.leaves(opt_state)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, templates)
        try:
            arrays = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except (ValueError, KeyError) as err:
            raise UserError(f"checkpoint {step} does not match this model: {err}") from err
        params = jax.tree.unflatten(jax.tree.structure(params), arrays["params"])
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), arrays["opt"])
        return eqx.combine(params, static), opt_state, meta


def load_latest(run_dir: str | Path):
    """(model, config, step) of a run's newest checkpoint, on the default device."""
    from moelab.model import Transformer
    from moelab.train.optimizer import make_optimizer, trainable

    if not (Path(run_dir) / "checkpoints").is_dir():
        raise UserError(f"no checkpoint in {Path(run_dir) / 'checkpoints'}; train a run first")
    ckpt = Checkpointer(Path(run_dir), keep=1_000_000)
    step = ckpt.latest_step()
    if step is None:
        raise UserError(f"no checkpoint in {Path(run_dir) / 'checkpoints'}; train a run first")
    cfg = config_from_dict(ckpt.read_meta(step)["config"])
    cfg = config_from_dict({**config_to_dict(cfg), "mesh": {"data": 1, "expert": 1}})
    # Shapes only: building a real random model just to overwrite it costs a compile.
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_device = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
    model = eqx.filter_eval_shape(Transformer, cfg.model, cfg.moe, jax.random.key(0))
    model = jax.tree.map(on_device, model)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps, None)
    opt_state = jax.tree.map(on_device, eqx.filter_eval_shape(
        lambda m: optimizer.init(trainable(m)), model))
    model, _, _ = ckpt.restore(step, model, opt_state, cfg)
    return model, cfg, step
