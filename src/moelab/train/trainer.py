"""`train(cfg, run_dir)`: the training loop, resuming from the run's last checkpoint.

Determinism is what makes resume exact: the loader's batch is a pure function of
(seed, step), params and optimizer state come back bit for bit from the checkpoint, and
the same jitted step runs on them, so the losses after a crash equal those of a run that
never crashed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from moelab.config import Config, ConfigError, DataConfig, config_to_dict
from moelab.data.loader import Loader, read_meta
from moelab.errors import DivergenceError, Interrupted, UserError
from moelab.model import Transformer
from moelab.parallel.distributed import initialize_distributed
from moelab.parallel.mesh import batch_sharding, init_sharded, make_mesh
from moelab.train.checkpoint import Checkpointer
from moelab.train.interrupt import StopRequest
from moelab.train.memory import check_fits
from moelab.train.metrics import mfu
from moelab.train.optimizer import lr_schedule, make_optimizer, trainable
from moelab.train.rundir import RunDirLock, check_identity, save_config
from moelab.train.runlog import RunLog
from moelab.train.spikes import SpikeDetector
from moelab.train.step import make_eval_step, make_train_step

FAULT_ENV = "MOELAB_FAULT_AT_STEP"  # test hook: SIGKILL this process when reaching that step


def prepared_data(cfg: Config) -> Path:
    """The dataset directory, preparing the built-in default corpus on first use."""
    path = Path(cfg.data.path)
    if not (path / "meta.json").exists() and cfg.data.path == DataConfig().path:
        from moelab.data.prepare import ensure_default_corpus

        print(f"preparing the default corpus at {path} (once)")
        ensure_default_corpus(path)
    meta = read_meta(path)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {meta['vocab_size']} tokens in {path}; raise it")
    return path


def build_model(cfg: Config, mesh):
    """The initial model, each array born on the mesh with its sharding."""
    model = init_sharded(lambda key: Transformer.init(cfg.model, cfg.moe, key), mesh,
                         jax.random.key(cfg.train.seed))
    if cfg.mesh.expert > 1:
        from moelab.parallel.expert import expert_parallel

        model = expert_parallel(model, mesh, cfg.mesh.exchange)
    return model


# model -> {"val_loss/<source>": loss}: replaces the sampled validation (the ladder's
# whole-val-split score, so every run's curve is measured on the same text)
Evaluator = Callable[[object], dict[str, float]]


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, experiment: str | None = None,
                 allow_config_change: bool = False, stop: StopRequest | None = None,
                 match_experiment: bool = False, evaluator: Evaluator | None = None):
        self.cfg, self.run_dir, self.evaluator = cfg, run_dir, evaluator
        self.stop = stop if stop is not None else StopRequest()
        # Before anything is written: a refused config leaves the run dir as it was.
        self.config_changes = check_identity(run_dir, cfg, allow_config_change)
        data_dir = prepared_data(cfg)
        d = cfg.data
        self.loader = Loader(data_dir, "train", d.seq_len, d.batch_size, d.mixture, d.seed,
                             d.max_epochs or None, cfg.train.steps * d.batch_size * d.seq_len)
        if d.mixture or d.max_epochs:
            print(f"mixture: {self.loader.mixture.report()}")
        self.val = {s: Loader(data_dir, "val", d.seq_len, d.batch_size, {s: 1.0}, d.seed)
                    for s in self.loader.sources}
        initialize_distributed(cfg.distributed)  # before any device is touched; no-op on 1 host
        check_fits(cfg)  # before allocating: a clear error, not an XLA out-of-memory
        self.mesh = make_mesh(cfg.mesh)
        self.model = build_model(cfg, self.mesh)
        self.optimizer = make_optimizer(cfg.optim, cfg.train.steps, None, cfg.model.d_model)
        # Sharded like the params, so the first step's output layout equals its input's
        # and the step compiles once.
        self.opt_state = init_sharded(self.optimizer.init, self.mesh, trainable(self.model))
        self.train_step = make_train_step(cfg, self.optimizer)
        self.eval_step = make_eval_step(cfg)
        self.lr = lr_schedule(cfg.optim, cfg.train.steps)
        t = cfg.train
        self.detectors = {name: SpikeDetector(t.spike_window, t.spike_threshold)
                          for name in ("loss", "grad_norm")}
        self.ckpt = Checkpointer(run_dir, t.keep_checkpoints)
        self.log = RunLog(run_dir, experiment, config_to_dict(cfg),
                          allow_config_change if match_experiment else None)
        self.step = self._resume()
        self._save_config()

    def _resume(self) -> int:
        found = self.ckpt.restore_latest_good(self.model, self.opt_state, self.cfg)
        if found is None:
            return 0
        self.model, self.opt_state, meta, step = found
        self.loader.load_state_dict(meta["loader"])
        for name, state in meta["detectors"].items():
            self.detectors[name].load_state_dict(state)
        self.log.rewind_to(step)
        self.log.event(step, "resume", f"resumed from checkpoint at step {step}")
        print(f"resumed from checkpoint at step {step}")
        return step

    def _save_config(self) -> None:
        path = save_config(self.run_dir, self.cfg, self.step, bool(self.config_changes))
        if self.config_changes:
            changed = {k: {"old": a, "new": b} for k, (a, b) in self.config_changes.items()}
            self.log.event(self.step, "config_change",
                           f"config changed at step {self.step} (saved as {path.name}): "
                           f"{json.dumps(changed)}")

    def save(self) -> None:
        state = {"config": config_to_dict(self.cfg), "step": self.step,
                 "loader": self.loader.state_dict(), "seed": self.cfg.train.seed,
                 "detectors": {k: d.state_dict() for k, d in self.detectors.items()}}
        try:
            self.ckpt.save(self.step, self.model, self.opt_state, state)
        except DivergenceError as err:
            self._diverged(str(err))

    def _maybe_stop(self) -> None:
        """On SIGTERM/SIGINT: save this step (unless just saved) and stop."""
        if not self.stop.requested:
            return
        if self.ckpt.latest_step() != self.step:
            self.save()
        self.log.event(self.step, "interrupted", f"stopped by signal {self.stop.signal}; "
                       f"checkpoint {self.step} saved")
        raise Interrupted(self.step)

    def _diverged(self, message: str, step: int | None = None) -> None:
        self.log.event(self.step if step is None else step, "nan", message)
        self.log.finish("failed", message)
        raise DivergenceError(message)

    def evaluate(self) -> dict[str, float]:
        if self.evaluator is not None:
            return self.evaluator(self.model)
        out = {}
        for source, loader in self.val.items():
            losses = [float(self.eval_step(self.model, self._on_mesh(loader.batch(i))))
                      for i in range(self.cfg.train.eval_batches)]
            out[f"val_loss/{source}"] = float(np.mean(losses))
        return out

    def _on_mesh(self, batch: np.ndarray):
        return jax.device_put(batch, batch_sharding(self.mesh))

    def run(self) -> dict:
        """Train to `train.steps`. The host runs one step ahead of its metrics: step N+1 is
        queued before step N's metrics are fetched (as MaxText does), so the device never
        waits for logging. Eval, checkpoint, progress and stop-request steps sync first:
        nothing is saved before its step's loss and gradient norm are checked finite."""
        t = self.cfg.train
        started, first, record = time.time(), self.step, self.log.last_record(self.step)
        self._maybe_stop()
        self._last_done = time.time()
        pending = None  # (step, device-side metrics) queued but not fetched yet
        while self.step < t.steps:
            self._maybe_fault()
            batch = self._on_mesh(next(self.loader))
            self.model, self.opt_state, parts = self.train_step(self.model, self.opt_state, batch)
            self.step += 1
            if pending is not None:
                self._complete(*pending)
            pending = (self.step, parts)
            boundary = (self.step % t.eval_every == 0, self.step % t.checkpoint_every == 0,
                        self.step % t.log_every == 0, self.step == t.steps)
            if any(boundary) or self.stop.requested:
                record = self._complete(*pending, evaluate=boundary[0] or boundary[3])
                pending = None
                if boundary[1] or boundary[3]:
                    self.save()
                if boundary[2] or boundary[3]:
                    self._print_progress(record, started, first)
                self._maybe_stop()
                self._last_done = time.time()  # the next step's time excludes this work
        if pending is not None:
            record = self._complete(*pending)
        self.log.finish("succeeded")
        return {"step": self.step, **record}

    def _complete(self, step: int, parts: dict, evaluate: bool = False) -> dict:
        """Fetch step `step`'s metrics (waiting for it to finish), check and log them."""
        parts = jax.device_get(parts)
        now = time.time()
        tokens_per_s = self.cfg.data.batch_size * self.cfg.data.seq_len / (now - self._last_done)
        self._last_done = now
        record = self._record(parts, self.lr(step - 1), tokens_per_s)
        self._check_finite(step, record)
        self._flag_spikes(step, record)
        if evaluate:
            record.update(self.evaluate())
        self.log.step(step, record)
        return record

    def _record(self, parts: dict, lr: float, tokens_per_s: float) -> dict:
        record = {k: float(parts[k]) for k in
                  ("loss", "ce", "aux_loss", "seq_aux_loss", "router_z", "logit_z",
                   "grad_norm")}
        record.update(lr=float(lr), tokens_per_s=tokens_per_s, mfu=mfu(self.cfg, tokens_per_s))
        for name in ("drop_frac", "sender_drop_frac", "padding_frac", "router_entropy",
                     "bias_range"):
            for i, value in enumerate(np.atleast_1d(parts.get(name, []))):
                record[f"{name}/layer_{i}"] = float(value)
        for i, load in enumerate(np.asarray(parts.get("tokens_per_expert", np.zeros((0, 1))))):
            record[f"expert_load_max_over_mean/layer_{i}"] = float(load.max() / load.mean())
        return record

    def _check_finite(self, step: int, record: dict) -> None:
        bad = [k for k in ("loss", "grad_norm") if not math.isfinite(record[k])]
        if bad:
            last = self.ckpt.latest_step()
            kept = ("no checkpoint was saved before it" if last is None
                    else f"checkpoint {last} stays the last good one")
            self._diverged(f"non-finite {' and '.join(bad)} at step {step}; stopping "
                           f"without saving, so {kept}", step)

    def _flag_spikes(self, step: int, record: dict) -> None:
        for name, detector in self.detectors.items():
            flag = detector.update(record[name])
            if flag:
                self.log.event(step, flag, f"{name} = {record[name]:.4g} flagged as {flag}")
                record[f"{flag}/{name}"] = 1.0

    def _maybe_fault(self) -> None:
        if os.environ.get(FAULT_ENV) == str(self.step):
            os.kill(os.getpid(), signal.SIGKILL)

    def _print_progress(self, record: dict, started: float, first: int) -> None:
        per_step = (time.time() - started) / max(self.step - first, 1)
        eta = per_step * (self.cfg.train.steps - self.step)
        vals = " ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in record.items()
                        if k.startswith("val_loss/"))
        print(f"step {self.step}/{self.cfg.train.steps} loss={record['loss']:.4f} "
              f"grad_norm={record['grad_norm']:.3f} tok/s={record['tokens_per_s']:.0f} "
              f"eta={eta:.0f}s {vals}".rstrip(), flush=True)


def train(cfg: Config, run_dir: str | Path, experiment: str | None = None,
          allow_config_change: bool = False, match_experiment: bool = False,
          evaluator: Evaluator | None = None) -> dict:
    """Train (or resume) the run in `run_dir`; returns the last step's metrics.

    Holds the run dir's lock throughout (a second trainer is refused) and turns
    SIGTERM/SIGINT into a checkpoint and `errors.Interrupted`. `match_experiment`: the
    config must be the experiment's snapshot (`moelab train --experiment`; a ladder's
    experiment holds many rungs' configs, so it does not ask for this). `evaluator`
    replaces the sampled validation (the ladder scores the whole val split).
    """
    try:
        with RunDirLock(Path(run_dir)), StopRequest() as stop:
            return Trainer(cfg, Path(run_dir), experiment, allow_config_change, stop,
                           match_experiment, evaluator).run()
    except FileNotFoundError as err:
        raise UserError(str(err)) from err
