"""Orbax checkpoints of params, optimizer state and run state (loader, detectors, RNG),
verified on every load.

Orbax writes each step into a temporary directory and renames it only once complete, so
a process killed mid-save leaves no checkpoint that would load wrong. That does not guard
against what happens to the files afterwards (a bad disk sector, a truncated copy, a
full disk), so once a save is complete an integrity record (`integrity.json`: the sha256
and size of every file) is written into the step's directory, and every loader (train
resume, export, generate, ladder) checks it first. A checkpoint whose files do not match,
or that fails to restore, is reported by step and reason and skipped for the newest good
one; the trainer also moves it aside to `checkpoints.bad/` (never deleted) so that its
step can be saved again. Parameters are checked finite and bounded before a save, so a
divergence is never checkpointed, and the records read back (integrity, run state) are
checked for structure as well as bytes: a malformed one is damage too.

Arrays are saved as flat leaf lists: the pytree structure comes from the config, which
is stored beside them and checked before anything is restored.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from moelab.config import Config, config_from_dict, config_to_dict, data_dir
from moelab.config.plan import stage_config
from moelab.errors import DivergenceError, UserError
from moelab.outputs import file_sha256
from moelab.parallel.mesh import is_tensor  # arrays or their shapes: restore templates
from moelab.schema import MapOf, Number, SchemaError, brief, check, read_json
from moelab.train import identity
from moelab.train.rundir import CHECKPOINT_DIR, QUARANTINE_DIR

INTEGRITY_FILE = "integrity.json"
# The shapes the loaders rely on; a checkpoint whose records differ is damaged.
INTEGRITY_SPEC = {"files": MapOf({"size": int, "sha256": str})}
# What every reader needs of the run state (export, generate: the config), and what
# resuming training needs.
CONFIG_SPEC = {"config": {"model": dict, "moe": dict}}
META_SPEC = {**CONFIG_SPEC, "step": int, "loader": {"step": int}, "seed": int,
             "detectors": MapOf({"history": [Number], "run_length": int})}
T = TypeVar("T")

# Fields whose change alters parameter shapes: a checkpoint is only loadable if they match.
SHAPE_FIELDS = {
    "model": ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "n_dense_layers", "d_ff_dense", "qk_norm", "tie_embeddings"],
    "moe": ["n_experts", "top_k", "shared_expert", "d_ff_shared"],
    "mtp": ["depth"],
}


def shape_mismatches(saved: dict, cfg: Config) -> list[str]:
    """A field a checkpoint's config lacks (written before the field existed) has its
    default, as when that config is loaded."""
    now, default = config_to_dict(cfg), config_to_dict(Config())
    was = lambda section, name: saved.get(section, {}).get(name, default[section][name])
    return [f"{section}.{name}: checkpoint {brief(was(section, name))}, "
            f"config {brief(now[section][name])}"
            for section, names in SHAPE_FIELDS.items() for name in names
            if was(section, name) != now[section][name]]


# ------------------------------------------------------------------------- integrity


def _files(step_dir: Path) -> dict[str, Path]:
    return {str(p.relative_to(step_dir)): p for p in sorted(step_dir.rglob("*"))
            if p.is_file() and p.name != INTEGRITY_FILE}


def write_integrity(step_dir: Path) -> None:
    """Record every file's size and sha256; atomically, so the record is whole or absent."""
    record = {name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
              for name, p in _files(step_dir).items()}
    tmp = step_dir / f".{INTEGRITY_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": record}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / INTEGRITY_FILE)


def verify_step(step_dir: Path) -> str | None:
    """Why the checkpoint in `step_dir` cannot be trusted, or None when every file matches."""
    try:
        record = read_json(step_dir / INTEGRITY_FILE, INTEGRITY_SPEC)["files"]
    except FileNotFoundError:
        return "no integrity record (its save never completed)"
    except SchemaError as err:
        return f"integrity record malformed ({err.problem})"
    present = _files(step_dir)
    for name, want in record.items():
        path = present.get(name)
        if path is None:
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
        if file_sha256(path) != want["sha256"]:
            return f"{name} does not match its sha256 (damaged on disk)"
    return None


def _disk_full(err: BaseException | None) -> bool:
    """Whether an error, or one it was raised from, is a full disk or quota."""
    while err is not None:
        if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or \
                "No space left" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def count_nonfinite(arrays: Any) -> tuple[int, int]:
    """(arrays with a NaN or Inf, arrays) over the float leaves of a pytree."""
    leaves = [x for x in jax.tree.leaves(arrays) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return 0, 0
    finite = jax.device_get(jnp.stack([jnp.isfinite(x).all() for x in leaves]))
    return int((~finite).sum()), len(leaves)


def max_abs(arrays: Any) -> float:
    """The largest |x| over the float leaves of a pytree (NaN if any is NaN)."""
    leaves = [x for x in jax.tree.leaves(arrays) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return 0.0
    return float(jax.device_get(jnp.stack([jnp.abs(x).max().astype(jnp.float32)
                                           for x in leaves]).max()))


def param_bound(arrays: Any) -> float:
    """Largest parameter magnitude a checkpoint may hold: sqrt(float32 max / n), n the
    parameter count. Norms, grad clipping and weight decay sum squares over all n
    parameters in float32; past this bound that sum can overflow to inf, so such a model
    is one step from non-finite. Trained weights are O(1), many orders of magnitude below."""
    n = sum(int(x.size) for x in jax.tree.leaves(arrays))
    return float(jnp.sqrt(jnp.finfo(jnp.float32).max / max(n, 1)))


# ------------------------------------------------------------------------- checkpointer


class Checkpointer:
    """Saves and restores a run's checkpoints, trusting only those that verify.

    A writer (the trainer, holding the run-dir lock) may change the directory:
    it removes the temporary directories of interrupted saves and moves damaged
    checkpoints aside. Readers (export, generate, ladder) only skip them.
    """

    def __init__(self, run_dir: Path, keep: int, writer: bool = True,
                 permanent: list[int] | tuple[int, ...] = ()):
        """Keeps the newest `keep` checkpoints, plus those of the `permanent` steps (stage
        boundaries, `train.keep_stage_checkpoints`), which rotation never deletes."""
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINT_DIR
        self.writer = writer
        if writer:
            self._remove_interrupted_saves()
        keeping = {"max_to_keep": keep if writer else None}
        if permanent:
            policies = ocp.checkpoint_managers
            keeping = {"preservation_policy": policies.AnyPreservationPolicy(
                [policies.LatestN(keep), policies.CustomSteps(list(permanent))])}
        # A reader asks for read_only and the settings it implies (orbax warns about each
        # one it has to change), and orbax's unconditional "Given directory is read only"
        # for what was asked is kept off the terminal of `export` and `generate`.
        options = ocp.CheckpointManagerOptions(
            **keeping, create=writer, enable_async_checkpointing=False, read_only=not writer,
            **({} if writer else {"save_interval_steps": 0}))
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        if not writer:
            absl_log.setLevel(logging.ERROR)
        try:
            self.manager = self._open(options)
        finally:
            absl_log.setLevel(level)

    def _open(self, options) -> ocp.CheckpointManager:
        """Orbax's manager over the directory. Orbax reads every step's metadata when it
        opens one, so a step whose metadata is damaged fails the whole run; then every
        step is verified and a writer moves the damaged ones aside and opens again, while
        a reader, which must not change the run, says which steps are damaged."""
        try:
            return ocp.CheckpointManager(self.directory, options=options)
        except Exception as err:  # noqa: BLE001 - orbax raises what its parsers raise
            failure = f"{type(err).__name__}: {str(err)[:200]}"
            damaged = [(step, reason) for step, reason in verify_run(self.run_dir) if reason]
            if not damaged:
                raise UserError(f"cannot open the checkpoints in {self.directory}: "
                                f"{failure}") from None
            if not self.writer:
                listed = "; ".join(f"checkpoint {step}: {reason}" for step, reason in damaged)
                raise UserError(f"cannot open the checkpoints in {self.directory} ({failure}): "
                                f"{listed}; resuming the run with `moelab train` moves damaged "
                                "checkpoints aside") from None
        for step, reason in damaged:
            self._move_aside(step, reason)
        try:
            return ocp.CheckpointManager(self.directory, options=options)
        except Exception as err:  # noqa: BLE001
            raise UserError(f"cannot open the checkpoints in {self.directory} even with the "
                            f"damaged ones moved aside: {type(err).__name__}: "
                            f"{str(err)[:200]}") from None

    def _remove_interrupted_saves(self) -> None:
        """Temporary directories of saves that a kill or a full disk interrupted."""
        if not self.directory.is_dir():
            return
        for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"removed {tmp.name}, the remains of an interrupted checkpoint save")

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def verify(self, step: int) -> str | None:
        return verify_step(self.directory / str(step))

    def save(self, step: int, model, opt_state, run_state: dict[str, Any]) -> None:
        """Save, then record the integrity of what was written; refuse non-finite params."""
        arrays = {"params": jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                  "opt": jax.tree.leaves(opt_state)}
        bad, total = count_nonfinite(arrays)
        largest, bound = max_abs(arrays["params"]), param_bound(arrays["params"])
        if bad or largest > bound:
            last = self.latest_step()
            kept = "no checkpoint was saved before" if last is None else \
                f"checkpoint {last} stays the last good one"
            what = (f"{bad} of {total} parameter/optimizer arrays are non-finite" if bad else
                    f"a parameter has magnitude {largest:.3g}, above the bound {bound:.3g} "
                    "(sqrt(float32 max / parameter count): beyond it a sum of squares over "
                    "the model overflows)")
            raise DivergenceError(f"{what} after the update of step {step}; not saving them, "
                                  f"{kept}")
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(run_state)))
            self.manager.wait_until_finished()
            if jax.process_index() == 0:
                write_integrity(self.directory / str(step))
        except Exception as err:
            if not _disk_full(err):
                raise
            # Orbax wraps the OS error; say it plainly. The unfinished save is a temporary
            # directory (or lacks its integrity record) and the next start discards it.
            raise OSError(errno.ENOSPC, f"no space left on the device while saving checkpoint "
                          f"{step} to {self.directory}") from err

    def read_meta(self, step: int, spec: Any = CONFIG_SPEC) -> dict:
        """The run state saved with `step`, checked: its structure (`spec`) and that the
        step stored inside equals the directory's (a renamed or swapped directory would
        otherwise resume, and log, as another step than the one it holds)."""
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"]
        where = self.directory / str(step) / "meta"
        check(meta, spec, where)
        stored = {meta.get("step", step), (meta.get("loader") or {}).get("step", step)}
        if stored != {step}:
            shown = " and ".join(brief(s, 20) for s in sorted(stored, key=str))
            raise SchemaError(where, f"stores step {shown}, but its directory is {step}")
        return meta

    def restore(self, step: int, model, opt_state, cfg: Config, spec: Any = CONFIG_SPEC):
        """(model, opt_state, run_state) at `step`, laid out like the given templates;
        `spec`: what the run state must hold (META_SPEC to resume training)."""
        meta = self.read_meta(step, spec)
        mismatches = shape_mismatches(meta["config"], cfg)
        if mismatches:
            raise UserError(
                f"checkpoint {step} in {self.directory} was written by an incompatible "
                f"config ({'; '.join(mismatches)}); use a new RUN_DIR or the original config")
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

    def restore_latest_good(self, model, opt_state, cfg: Config):
        """(model, opt_state, run_state, step) of the newest checkpoint that verifies and
        restores; None when the run has no checkpoint yet."""
        return self.newest_good(
            lambda step: (*self.restore(step, model, opt_state, cfg, META_SPEC), step))

    def newest_good(self, load: Callable[[int], T]) -> T | None:
        """`load(step)` of the newest checkpoint that verifies and loads, reporting (and for
        a writer, moving aside) each damaged one on the way; None when there is none at
        all, a UserError when there are some but every one is damaged."""
        steps = self.steps()
        for step in reversed(steps):
            reason = self.verify(step)
            if reason is None:
                try:
                    return load(step)
                except SchemaError as err:  # a malformed record is damage, like bad bytes
                    reason = err.problem
                except UserError:
                    raise  # an incompatible config is the user's to fix, not damage
                except Exception as err:  # noqa: BLE001 - any failure to restore is damage
                    reason = f"restore failed ({type(err).__name__}: {str(err)[:200]})"
            self._reject(step, reason)
        if steps:
            raise UserError(f"every checkpoint in {self.directory} is damaged (steps "
                            f"{', '.join(map(str, steps))}; reasons above); use a new "
                            "RUN_DIR to start over")
        return None

    def _reject(self, step: int, reason: str) -> None:
        """Report a damaged checkpoint; the trainer also moves it aside (never deletes it)."""
        if self.writer:
            self._move_aside(step, reason, "; using an older one")
            self.manager.reload()
        else:
            print(f"checkpoint {step} is damaged: {reason}; using an older one",
                  file=sys.stderr, flush=True)

    def _move_aside(self, step: int, reason: str, then: str = "") -> None:
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}.{time.time_ns() % 10**9:09d}"
        aside = self.run_dir / QUARANTINE_DIR / f"{step}-{stamp}"  # unique: never overwrite
        aside.parent.mkdir(exist_ok=True)
        os.replace(self.directory / str(step), aside)
        print(f"checkpoint {step} is damaged: {reason}; moved aside to {aside}{then}",
              file=sys.stderr, flush=True)


def verify_run(run_dir: str | Path) -> list[tuple[int, str | None]]:
    """(step, reason or None) for every checkpoint of a run, oldest first; read-only."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        raise UserError(f"no checkpoints in {directory}; pass the RUN_DIR of a training run")
    steps = sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())
    return [(step, verify_step(directory / str(step))) for step in steps]


def load_latest(run_dir: str | Path, only_step: int | None = None):
    """(model, config, step) of a run's newest good checkpoint, on the default device
    (only_step: that checkpoint, which must verify). The config and the model are those of
    the stage that trained the checkpoint's last step (`plan.stage_config`): a run whose
    last stage extended the context exports, generates and evaluates with that stage's
    RoPE and seq_len."""
    from moelab.model import init_model
    from moelab.train.optimizer import make_optimizer, trainable

    if not (Path(run_dir) / CHECKPOINT_DIR).is_dir():
        raise UserError(f"no checkpoint in {Path(run_dir) / CHECKPOINT_DIR}; train a run first")
    ckpt = Checkpointer(Path(run_dir), keep=1_000_000, writer=False)

    def load(step: int):
        meta = ckpt.read_meta(step)
        try:
            cfg = config_from_dict(meta["config"])
        except UserError as err:  # the stored config is part of the checkpoint: damage
            raise SchemaError(ckpt.directory / str(step) / "meta", f"config: {err}") from None
        identity.check(meta, Path(run_dir), data_dir(cfg.data.path), step)
        cfg = config_from_dict({**config_to_dict(cfg), "mesh": {"data": 1, "expert": 1}})
        cfg = stage_config(cfg, cfg.plan.at(max(step - 1, 0)))
        # Shapes only: building a real random model just to overwrite it costs a compile.
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        on_device = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
        model = eqx.filter_eval_shape(init_model, cfg, jax.random.key(0))
        model = jax.tree.map(on_device, model)
        optimizer = make_optimizer(cfg.optim, cfg.train.steps, None, cfg.model.d_model)
        opt_state = jax.tree.map(on_device, eqx.filter_eval_shape(
            lambda m: optimizer.init(trainable(m)), model))
        return ckpt.restore(step, model, opt_state, cfg)[0], cfg, step

    if only_step is not None:
        if only_step not in ckpt.steps():
            raise UserError(f"no checkpoint {only_step} in {ckpt.directory}; it has steps "
                            f"{ckpt.steps()}")
        reason = ckpt.verify(only_step)
        if reason is not None:
            raise UserError(f"checkpoint {only_step} in {ckpt.directory} is damaged: {reason}")
        return load(only_step)
    found = ckpt.newest_good(load)
    if found is None:
        raise UserError(f"no checkpoint in {ckpt.directory}; train a run first")
    return found


def checkpoint_identity(run_dir: str | Path, step: int) -> dict[str, Any]:
    """The identity (run id, corpus and tokenizer sha256) checkpoint `step` recorded; {}
    for a checkpoint from before identities were recorded."""
    meta = Checkpointer(Path(run_dir), keep=1_000_000, writer=False).read_meta(step)
    found = meta.get(identity.IDENTITY_KEY)
    return found if isinstance(found, dict) else {}


def restore_weights(run_dir: str | Path, into, cfg: Config, step: int | None = None):
    """`into` (a model built from `cfg`) with every parameter replaced by a checkpoint's:
    weights only, no optimizer or loader state, each array placed like `into`'s.

    A new stage starts from another run's weights under a new config: a longer seq_len,
    another batch size or RoPE scaling (none of which changes a parameter's shape), so the
    structure comes from `cfg` and only the shape fields must match the checkpoint's.
    `step`: that checkpoint (it must verify), or None for the run's newest good one.
    """
    saved, saved_cfg, saved_step = load_latest(run_dir, only_step=step)
    mismatches = shape_mismatches(config_to_dict(saved_cfg), cfg)
    if mismatches:
        raise UserError(f"checkpoint {saved_step} of {run_dir} cannot seed this config "
                        f"({'; '.join(mismatches)}); only non-shape fields may change")
    target, static = eqx.partition(into, is_tensor)
    arrays = jax.tree.leaves(eqx.filter(saved, is_tensor))
    placed = [jax.device_put(a, t.sharding) for a, t in zip(arrays, jax.tree.leaves(target),
                                                             strict=True)]
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(target), placed), static)

