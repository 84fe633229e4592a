"""`train(cfg, run_dir)`: the training loop, resuming from the run's last checkpoint.

Determinism is what makes resume exact: the loader's batch is a pure function of
(seed, step), params and optimizer state come back bit for bit from the checkpoint, and
the same jitted step runs on them, so the losses after a crash equal those of a run that
never crashed.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from moelab.config import Config, ConfigError, DataConfig, config_to_dict, dump_config
from moelab.data.loader import Loader, read_meta
from moelab.errors import UserError
from moelab.model import Transformer
from moelab.parallel.distributed import initialize_distributed
from moelab.parallel.mesh import batch_sharding, make_mesh, place
from moelab.train.checkpoint import Checkpointer
from moelab.train.metrics import mfu
from moelab.train.optimizer import lr_schedule, make_optimizer, trainable
from moelab.train.runlog import RunLog
from moelab.train.spikes import SpikeDetector
from moelab.train.step import make_eval_step, make_train_step

FAULT_ENV = "MOELAB_FAULT_AT_STEP"  # test hook: SIGKILL this process when reaching that step


class DivergenceError(RuntimeError):
    """The loss or gradient became non-finite; the last good checkpoint is kept."""


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
    model = place(Transformer(cfg.model, cfg.moe, jax.random.key(cfg.train.seed)), mesh)
    if cfg.mesh.expert > 1:
        from moelab.parallel.expert import expert_parallel

        model = expert_parallel(model, mesh)
    return model


# model -> {"val_loss/<source>": loss}: replaces the sampled validation (the ladder's
# whole-val-split score, so every run's curve is measured on the same text)
Evaluator = Callable[[object], dict[str, float]]


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, experiment: str | None = None,
                 evaluator: Evaluator | None = None):
        self.cfg, self.run_dir, self.evaluator = cfg, run_dir, evaluator
        run_dir.mkdir(parents=True, exist_ok=True)
        data_dir = prepared_data(cfg)
        d = cfg.data
        self.loader = Loader(data_dir, "train", d.seq_len, d.batch_size, d.mixture, d.seed)
        self.val = {s: Loader(data_dir, "val", d.seq_len, d.batch_size, {s: 1.0}, d.seed)
                    for s in self.loader.sources}
        initialize_distributed(cfg.distributed)  # before any device is touched; no-op on 1 host
        self.mesh = make_mesh(cfg.mesh)
        self.model = build_model(cfg, self.mesh)
        self.optimizer = make_optimizer(cfg.optim, cfg.train.steps, None)
        # Placed like the params, so the first step's output layout equals its input's
        # and the step compiles once.
        self.opt_state = place(self.optimizer.init(trainable(self.model)), self.mesh)
        self.train_step = make_train_step(cfg, self.optimizer)
        self.eval_step = make_eval_step(cfg)
        self.lr = lr_schedule(cfg.optim, cfg.train.steps)
        t = cfg.train
        self.detectors = {name: SpikeDetector(t.spike_window, t.spike_threshold)
                          for name in ("loss", "grad_norm")}
        self.ckpt = Checkpointer(run_dir, t.keep_checkpoints)
        self.log = RunLog(run_dir, experiment, config_to_dict(cfg))
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        self.step = self._resume()

    def _resume(self) -> int:
        step = self.ckpt.latest_step()
        if step is None:
            return 0
        self.model, self.opt_state, meta = self.ckpt.restore(
            step, self.model, self.opt_state, self.cfg)
        self.loader.load_state_dict(meta["loader"])
        for name, state in meta["detectors"].items():
            self.detectors[name].load_state_dict(state)
        self.log.rewind_to(step)
        self.log.event(step, "resume", f"resumed from checkpoint at step {step}")
        print(f"resumed from checkpoint at step {step}")
        return step

    def save(self) -> None:
        state = {"config": config_to_dict(self.cfg), "step": self.step,
                 "loader": self.loader.state_dict(), "seed": self.cfg.train.seed,
                 "detectors": {k: d.state_dict() for k, d in self.detectors.items()}}
        self.ckpt.save(self.step, self.model, self.opt_state, state)

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
        t, tokens_per_step = self.cfg.train, self.cfg.data.batch_size * self.cfg.data.seq_len
        started, first, record = time.time(), self.step, {}
        while self.step < t.steps:
            self._maybe_fault()
            tick = time.time()
            batch = self._on_mesh(next(self.loader))
            self.model, self.opt_state, parts = self.train_step(self.model, self.opt_state, batch)
            record = self._record(parts, self.lr(self.step), tokens_per_step / (time.time() - tick))
            self.step += 1
            self._check_finite(record)
            self._flag_spikes(record)
            if self.step % t.eval_every == 0 or self.step == t.steps:
                record.update(self.evaluate())
            self.log.step(self.step, record)
            if self.step % t.checkpoint_every == 0 or self.step == t.steps:
                self.save()
            if self.step % t.log_every == 0 or self.step == t.steps:
                self._print_progress(record, started, first)
        self.log.finish("succeeded")
        return {"step": self.step, **record}

    def _record(self, parts: dict, lr: float, tokens_per_s: float) -> dict:
        parts = jax.device_get(parts)
        record = {k: float(parts[k]) for k in
                  ("loss", "ce", "aux_loss", "router_z", "logit_z", "grad_norm")}
        record.update(lr=float(lr), tokens_per_s=tokens_per_s, mfu=mfu(self.cfg, tokens_per_s))
        for i, drop in enumerate(np.atleast_1d(parts.get("drop_frac", []))):
            record[f"drop_frac/layer_{i}"] = float(drop)
        for i, load in enumerate(np.asarray(parts.get("tokens_per_expert", np.zeros((0, 1))))):
            record[f"expert_load_max_over_mean/layer_{i}"] = float(load.max() / load.mean())
        return record

    def _check_finite(self, record: dict) -> None:
        bad = [k for k in ("loss", "grad_norm") if not math.isfinite(record[k])]
        if bad:
            message = (f"non-finite {' and '.join(bad)} at step {self.step}; stopping without "
                       f"saving, so checkpoint {self.ckpt.latest_step()} stays the last good one")
            self.log.event(self.step, "nan", message)
            self.log.finish("failed", message)
            raise DivergenceError(message)

    def _flag_spikes(self, record: dict) -> None:
        for name, detector in self.detectors.items():
            flag = detector.update(record[name])
            if flag:
                self.log.event(self.step, flag, f"{name} = {record[name]:.4g} flagged as {flag}")
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
          evaluator: Evaluator | None = None) -> dict:
    """Train (or resume) the run in `run_dir`; returns the last step's metrics."""
    try:
        return Trainer(cfg, Path(run_dir), experiment, evaluator).run()
    except FileNotFoundError as err:
        raise UserError(str(err)) from err
