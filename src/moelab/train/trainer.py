"""`train(cfg, run_dir)`: the training loop, resuming from the run's last checkpoint.

Determinism is what makes resume exact: the loader's batch is a pure function of
(seed, step), params and optimizer state come back bit for bit from the checkpoint, and
the same jitted step runs on them, so the losses after a crash equal those of a run that
never crashed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from moelab.config import (
    Config,
    ConfigError,
    DataConfig,
    config_from_dict,
    config_to_dict,
    data_dir,
)
from moelab.config.plan import Stage, check_sources, stage_config
from moelab.data.loader import (
    ConversationLoader,
    Loader,
    StagedLoader,
    read_meta,
    source_weights,
)
from moelab.data.passes import passes_lines, plan_passes
from moelab.errors import DivergenceError, Interrupted, UserError
from moelab.model import Transformer, init_model
from moelab.model.dispatch import check_dispatch
from moelab.model.losses import MTP_LOSS_PREFIX
from moelab.model.transformer import with_model_config
from moelab.parallel.distributed import initialize_distributed
from moelab.parallel.mesh import batch_sharding, init_sharded, make_mesh
from moelab.train import identity
from moelab.train.bpb import LOSS_PREFIX, domain_metrics, tokenizer_bytes
from moelab.train.checkpoint import Checkpointer
from moelab.train.health import DEAD_METRIC, ExpertHealth
from moelab.train.interrupt import StopRequest, describe, stop_at_once
from moelab.train.memory import check_fits, keep_freed_memory
from moelab.train.metrics import mfu
from moelab.train.optimizer import make_optimizer, run_schedule, trainable, with_schedule_step
from moelab.train.rundir import (
    CHECKPOINT_DIR,
    LAB_RUN_FILE,
    LINEAGE_FILE,
    METRICS_FILE,
    QUARANTINE_DIR,
    RunDirLock,
    check_checkpoint_config,
    check_identity,
    save_config,
)
from moelab.train.runlog import RunLog, check_snapshot
from moelab.train.spikes import (
    OverfitDetector,
    SpikeDetector,
    diverging,
    plausible_loss_bound,
)
from moelab.train.step import make_eval_step, make_train_step

FAULT_ENV = "MOELAB_FAULT_AT_STEP"  # test hook: SIGKILL this process when reaching that step


def prepared_data(cfg: Config) -> Path:
    """The dataset directory (`config.data_dir`), preparing the built-in default corpus on
    first use. A stop there (SIGINT/SIGTERM) ends at once with `Interrupted`: there is no
    step to finish, and a rerun resumes the preparation where it stopped."""
    path = data_dir(cfg.data.path)
    if not (path / "meta.json").exists() and cfg.data.path == DataConfig().path:
        from moelab.data.prepare import ensure_default_corpus

        print(f"preparing the default corpus at {path} (once)", flush=True)
        try:
            with stop_at_once():
                ensure_default_corpus(path)
        except KeyboardInterrupt:
            raise Interrupted(None, f"interrupted while preparing the corpus at {path}; "
                              "rerun the same command to resume it") from None
        print(f"corpus ready: {path}, content sha256 "
              f"{read_meta(path).get('content_sha256', 'unknown')}", flush=True)
    from moelab.data.prepare import check_preset_prepared

    check_preset_prepared(cfg.data.path)
    here = Path(cfg.data.path)
    if not (path / "meta.json").exists() and (here / "meta.json").exists() and here != path:
        raise ConfigError(f"data.path: {cfg.data.path!r} means {path} (relative paths live "
                          f"under $MOELAB_HOME), which holds no dataset; for the one in the "
                          f"working directory write data.path: ./{cfg.data.path}")
    meta = read_meta(path)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {meta['vocab_size']} tokens in {path}; raise it")
    return path


def build_model(cfg: Config, mesh):
    """The initial model, each array born on the mesh with its sharding."""
    model = init_sharded(lambda key: init_model(cfg, key), mesh, jax.random.key(cfg.train.seed))
    if cfg.mesh.expert > 1:
        from moelab.parallel.expert import expert_parallel

        model = expert_parallel(model, mesh, cfg.mesh.exchange)
    return model


@dataclasses.dataclass(frozen=True)
class Parent:
    """Where a branch starts (`moelab train --from RUN_DIR[@STEP] [--weights-only]`)."""

    run_dir: Path
    step: int | None = None  # None: the parent's newest good checkpoint
    weights_only: bool = False  # fresh optimizer state (Delphi) instead of the parent's


# model -> {"val_loss/<source>": loss, "val_bpb/<source>": bpb, ...}: replaces the sampled
# validation (the ladder's whole-val-split score, so every run's curve is measured on the
# same text)
Evaluator = Callable[[object], dict[str, float]]


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, experiment: str | None = None,
                 allow_config_change: bool = False, stop: StopRequest | None = None,
                 match_experiment: bool = False, evaluator: Evaluator | None = None,
                 parent: Parent | None = None):
        self.cfg, self.run_dir, self.evaluator, self.parent = cfg, run_dir, evaluator, parent
        self.stop = stop if stop is not None else StopRequest()
        self.allow_config_change = allow_config_change
        # Before anything is written: a refused config leaves the run dir as it was.
        self.config_changes = check_identity(run_dir, cfg, allow_config_change)
        data_dir = prepared_data(cfg)
        self.data_dir, self.corpus = data_dir, identity.corpus_identity(data_dir)
        d = cfg.data
        self.plan = cfg.plan
        self.loader = Loader(data_dir, "train", d.seq_len, d.batch_size, d.mixture, d.seed,
                             d.max_epochs or None, cfg.train.steps * d.batch_size * d.seq_len,
                             d.unique_tokens, d.unique_sample)
        if d.mixture or d.max_epochs or d.unique_tokens:
            print(f"mixture: {self.loader.mixture.report()}")
        if self.plan.staged:
            check_sources(self.plan, self.loader.sources)
            self.loader = StagedLoader(data_dir, self.plan.stages, d.seed, d.unique_tokens,
                                       d.unique_sample)
        self.passes: list[dict] | None = None  # per stage, as moelab.data.passes counts
        if d.conversations:  # the plan still sets the LR and optimizer of each stage
            self.loader = ConversationLoader(data_dir, d.conversations, d.seq_len,
                                             d.batch_size, d.seed)
        else:
            self.passes = plan_passes(self.loader.meta, self.plan, d.max_epochs or None)
            for line in passes_lines(self.passes):
                print(f"train tokens, {line}")
        # val keeps the run's seq_len and batch in every stage: one yardstick for the curve
        self.val = {s: Loader(data_dir, "val", d.seq_len, d.batch_size, {s: 1.0}, d.seed)
                    for s in self.loader.sources}
        self.token_bytes = tokenizer_bytes(data_dir)  # None: a dataset without a tokenizer
        initialize_distributed(cfg.distributed)  # before any device is touched; no-op on 1 host
        for stage in self.plan.stages:  # before allocating: a clear error, not an XLA OOM
            try:
                check_fits(stage_config(cfg, stage))
            except ConfigError as err:
                if not self.plan.staged:
                    raise
                raise ConfigError(f"{self.plan.name_of(stage)}.seq_len: {stage.seq_len} x batch "
                                  f"{stage.batch_size}: {err}") from None
        self.mesh = make_mesh(cfg.mesh)
        self.model = build_model(cfg, self.mesh)
        self.lr = run_schedule(cfg)
        self.optimizer = make_optimizer(cfg.optim, cfg.train.steps, None, cfg.model.d_model,
                                        self.lr)
        # Sharded like the params, so the first step's output layout equals its input's
        # and the step compiles once.
        self.opt_state = self._fresh_opt_state()
        self.train_step = make_train_step(cfg, self.optimizer)
        self._step_cut = (cfg.data.short_rows, cfg.data.short_len)  # what train_step masks
        self.eval_step = make_eval_step(cfg)
        t = cfg.train
        self.detectors = {name: SpikeDetector(t.spike_window, t.spike_threshold)
                          for name in ("loss", "grad_norm")}
        self.overfit = OverfitDetector()
        self.health = ExpertHealth(t.dead_expert_window)
        permanent = self.plan.starts() if t.keep_stage_checkpoints else []
        self.ckpt = Checkpointer(run_dir, t.keep_checkpoints, permanent=permanent)
        self.log = RunLog(run_dir, experiment, config_to_dict(cfg),
                          allow_config_change if match_experiment else None,
                          fork=self._fork_point())
        self.step = self._resume()
        self._save_config()

    def _fork_point(self) -> tuple[Path, int] | None:
        """(parent run dir, step) of a branch about to start, for the lab's W&B mirror;
        None for a plain run or one that already started (its own checkpoints exist). A
        bad --from is refused later, by `_branch`, with its own message."""
        if self.parent is None or self.ckpt.steps():
            return None
        src = Path(self.parent.run_dir)
        if self.parent.step is not None:
            return src, self.parent.step
        steps = Checkpointer(src, keep=1_000_000, writer=False).steps() \
            if (src / CHECKPOINT_DIR).is_dir() else []
        return (src, steps[-1]) if steps else None

    def _fresh_opt_state(self, step: int = 0):
        """New AdamW moments, placed like the params, reading the LR of `step`."""
        state = init_sharded(self.optimizer.init, self.mesh, trainable(self.model))
        return with_schedule_step(state, step) if step else state

    def _resume(self) -> int:
        found = self.ckpt.restore_latest_good(self.model, self.opt_state, self.cfg)
        if found is None:
            if self.parent is not None:
                return self._branch(self.parent)
            self._start_without_checkpoint()
            return 0
        if self.parent is not None and not (self.run_dir / LINEAGE_FILE).exists():
            raise UserError(f"--from: {self.run_dir} already holds a run of its own; a branch "
                            "starts in a new RUN_DIR")
        self.model, self.opt_state, meta, step = found
        # Its own config stands in for a deleted config.yaml, and must be this run's.
        self.config_changes = check_checkpoint_config(
            self.run_dir, self.cfg, self.allow_config_change, step, meta["config"]
        ) or self.config_changes
        identity.check(meta, self.run_dir, self.data_dir, step)  # the same config, this run?
        self._check_plan_change(meta["config"], step)
        self.loader.load_state_dict(meta["loader"])
        for name, state in meta["detectors"].items():
            self.detectors[name].load_state_dict(state)
        if "overfit" in meta:  # a checkpoint of an older moelab starts it afresh
            self.overfit.load_state_dict(meta["overfit"])
        if "health" in meta:  # checkpoints from before balance health have none
            self.health.load_state_dict(meta["health"])
        self.log.rewind_to(step)
        self.log.event(step, "resume", f"resumed from checkpoint at step {step}")
        print(f"resumed from checkpoint at step {step}")
        return step

    def _branch(self, parent: Parent) -> int:
        """Start this run from a verified checkpoint of another run: its weights (and unless
        weights_only its optimizer state) at its step, so this run's curve forks there."""
        src = Path(parent.run_dir).absolute()
        if src == self.run_dir.absolute():
            raise UserError(f"--from {parent.run_dir}: that is this run's own RUN_DIR")
        if not (src / CHECKPOINT_DIR).is_dir():
            raise UserError(f"--from {parent.run_dir}: no checkpoints there; pass the run dir "
                            "of a training run")
        ckpt = Checkpointer(src, keep=1_000_000, writer=False)
        steps = ckpt.steps()
        step = parent.step if parent.step is not None else (steps[-1] if steps else None)
        if step not in steps:
            raise UserError(f"--from {parent.run_dir}@{parent.step}: no checkpoint at that step; "
                            f"it keeps steps {steps}")
        reason = ckpt.verify(step)
        if reason is not None:
            raise UserError(f"--from {parent.run_dir}@{step}: the checkpoint is damaged "
                            f"({reason}); pick another step")
        if step >= self.cfg.train.steps:
            raise UserError(f"--from {parent.run_dir}@{step}: the branch must train past step "
                            f"{step}; raise train.steps ({self.cfg.train.steps})")
        self.model, opt_state, _ = ckpt.restore(step, self.model, self.opt_state, self.cfg)
        self.opt_state = self._fresh_opt_state(step) if parent.weights_only else opt_state
        self.loader.step = step  # a batch is a function of the step: the plan goes on from it
        lab_run = (json.loads((src / LAB_RUN_FILE).read_text())["run_id"]
                   if (src / LAB_RUN_FILE).exists() else None)
        lineage = {"parent_run_dir": str(src), "step": step, "parent_lab_run": lab_run,
                   "optimizer_state": "fresh" if parent.weights_only else "parent's"}
        path = self.run_dir / LINEAGE_FILE
        if not path.exists():
            self.log.event(step, "branch", f"branched from {src}@{step} (lab run {lab_run}) "
                           f"with {lineage['optimizer_state']} optimizer state")
            path.write_text(json.dumps(lineage))
        self.log.rewind_to(step)
        print(f"branched from {src} at step {step}")
        return step

    def _check_plan_change(self, saved: dict, step: int) -> None:
        """Refuse a resume whose plan changes a stage that has trained (one-line error);
        stages yet to start may change, recorded as a plan_change event."""
        old = config_from_dict(saved).plan
        if not (old.staged or self.plan.staged):
            return  # one implicit stage: train.steps may change (a cooldown branch does)
        changed = old.started_changes(self.plan, step)
        if changed:
            raise ConfigError(f"stages: the plan changes {', '.join(changed)}, which has "
                              f"already trained (resuming at step {step}); only stages that "
                              "start later may change: branch instead with `moelab train "
                              f"--from {self.run_dir}@STEP` into a new RUN_DIR")

    def _start_without_checkpoint(self) -> None:
        """Start at step 0, unless the run directory shows that a checkpoint existed:
        retraining then would log steps 1..N a second time. A record past the first
        checkpoint step proves one (the save completes before the next step is logged),
        as do a resume or interrupt event and checkpoints moved aside as damaged. Records
        before it are from a start killed before its first save: nothing was kept, so
        they are dropped and recomputed, with an event saying so."""
        first_save = self.cfg.train.checkpoint_every
        metrics, events = self.log.metrics.read(), self.log.events.read()
        last = max((r["step"] for r in metrics + events), default=0)
        quarantine = self.run_dir / QUARANTINE_DIR
        damaged = sorted(p.name for p in quarantine.iterdir()) if quarantine.is_dir() else []
        evidence = [f"metrics/events up to step {last}"] if last > first_save else []
        evidence += sorted({f"a {e['kind']} event at step {e['step']}" for e in events
                            if e["kind"] in ("resume", "interrupted")})[:3]
        evidence += [f"{len(damaged)} damaged checkpoint(s) in {QUARANTINE_DIR}/"] * \
            bool(damaged)
        if evidence:
            raise UserError(
                f"{self.run_dir} holds the history of a run that saved checkpoints "
                f"({'; '.join(evidence)}) but no usable checkpoint in checkpoints/; training "
                "again from step 0 would repeat its steps in the same record. Rerun with "
                "--restart-from-scratch to archive the old files (to history-*/) and start "
                "over, or pass a new RUN_DIR")
        if metrics:
            self.log.rewind_to(0)
            self.log.event(0, "fresh_start", f"no checkpoint was saved before (the first is "
                           f"due at step {first_save}); the {len(metrics)} steps logged "
                           "before were dropped and are recomputed from step 0")

    def _save_config(self) -> None:
        path = save_config(self.run_dir, self.cfg, self.step, bool(self.config_changes))
        if "stages" in self.config_changes:
            old, new = self.config_changes["stages"]
            diff = json.dumps({"old": old, "new": new})
            self.log.event(self.step, "plan_change", f"stages not started by step {self.step} "
                           f"changed (saved as {path.name}): {diff}")
        elif self.config_changes:
            changed = {k: {"old": a, "new": b} for k, (a, b) in self.config_changes.items()}
            self.log.event(self.step, "config_change",
                           f"config changed at step {self.step} (saved as {path.name}): "
                           f"{json.dumps(changed)}")

    def save(self) -> None:
        refused = self._implausible()
        if refused:
            self._refuse_save(refused)
        state = {"config": config_to_dict(self.cfg), "step": self.step,
                 "loader": self.loader.state_dict(), "seed": self.cfg.train.seed,
                 "detectors": {k: d.state_dict() for k, d in self.detectors.items()},
                 "overfit": self.overfit.state_dict(),
                 "health": self.health.state_dict(),
                 identity.IDENTITY_KEY: {"run_id": identity.ensure_run_id(self.run_dir),
                                         **self.corpus}}
        try:
            self.ckpt.save(self.step, self.model, self.opt_state, state)
        except DivergenceError as err:
            self._refuse_save(str(err))

    def _implausible(self) -> str | None:
        """Why the model about to be saved is a divergence though finite, or None. The
        loss of the params being saved (one val batch: the logged loss is that of the
        previous params) must be below plausible_loss_bound, and the spike rule must not
        call the training loss diverging. Parameter magnitudes are the checkpointer's."""
        bound = plausible_loss_bound(self.cfg.model.vocab_size)
        val = next(iter(self.val.values()))
        loss = float(self.eval_step(self.model, self._on_mesh(val.batch(0))))
        if not loss <= bound:  # NaN too
            return (f"the model's loss is {loss:.4g} (one val batch), above the bound "
                    f"{bound:.4g} = 3 ln(vocab_size) that no training run passes through")
        detector = self.detectors["loss"]
        if diverging(detector):
            return (f"the training loss has been flagged as a spike {detector.run_length} "
                    "steps in a row (the spike rule's divergence)")
        return None

    def _refuse_save(self, why: str) -> None:
        """A checkpoint that fails the checks is not written: event, then exit 3."""
        last = self.ckpt.latest_step()
        kept = ("no checkpoint passed before it" if last is None else
                f"checkpoint {last} is the last one that passed")
        message = f"refused to save checkpoint {self.step}: {why}; stopping; {kept}"
        self.log.event(self.step, "save_refused", message)
        self.log.finish("failed", message)
        raise DivergenceError(message)

    def _maybe_stop(self) -> None:
        """On SIGTERM/SIGINT: save this step (unless just saved) and stop."""
        if not self.stop.requested:
            return
        if self.ckpt.latest_step() != self.step:
            self.save()
        self.log.event(self.step, "interrupted", f"{describe(self.stop.signal)}; "
                       f"checkpoint {self.step} saved")
        raise Interrupted(self.step)

    def _diverged(self, message: str, step: int | None = None) -> None:
        self.log.event(self.step if step is None else step, "nan", message)
        self.log.finish("failed", message)
        raise DivergenceError(message)

    def evaluate(self) -> dict[str, float]:
        if self.evaluator is not None:
            return self.evaluator(self.model)
        nll, tokens, n_bytes = {}, {}, {}
        for source, loader in self.val.items():
            batches = [loader.batch(i) for i in range(self.cfg.train.eval_batches)]
            # eval_step is the mean CE of a batch; every batch has B*S targets
            nll[source] = sum(float(self.eval_step(self.model, self._on_mesh(b))) * b[:, 1:].size
                              for b in batches)
            tokens[source] = sum(b[:, 1:].size for b in batches)
            if self.token_bytes is not None:
                n_bytes[source] = sum(int(self.token_bytes[b[:, 1:]].sum()) for b in batches)
        return domain_metrics(nll, tokens, n_bytes if self.token_bytes is not None else None)

    def _on_mesh(self, batch: np.ndarray):
        return jax.device_put(batch, batch_sharding(self.mesh))

    def run(self) -> dict:
        """Train to `train.steps`. The host runs one step ahead of its metrics: step N+1 is
        queued before step N's metrics are fetched (as MaxText does), so the device never
        waits for logging. Eval, checkpoint, progress and stop-request steps sync first:
        nothing is saved before its step's loss and gradient norm are checked finite."""
        t = self.cfg.train
        record = self.log.last_record(self.step)
        rate_from = None  # (time, step) once the first step is compiled: the ETA's origin
        self._maybe_stop()
        self._last_done = time.time()
        pending = None  # (step, device-side metrics) queued but not fetched yet
        while self.step < t.steps:
            self._maybe_fault()
            self._enter_stage()
            batch = self._on_mesh(next(self.loader))
            self.model, self.opt_state, parts = self.train_step(self.model, self.opt_state, batch)
            self.step += 1
            if rate_from is None:  # the call returns once compiled (seconds on CPU)
                rate_from = (time.time(), self.step)
            if pending is not None:
                self._complete(*pending)
            pending = (self.step, parts)
            at_boundary = self.plan.staged and self.step in self.plan.starts()
            stage_end = t.keep_stage_checkpoints and at_boundary
            # a stage's end is always evaluated: the ladder predicts the loss there
            boundary = (self.step % t.eval_every == 0 or at_boundary,
                        self.step % t.checkpoint_every == 0 or stage_end,
                        self.step % t.log_every == 0, self.step == t.steps)
            if any(boundary) or self.stop.requested:
                record = self._complete(*pending, evaluate=boundary[0] or boundary[3])
                pending = None
                if boundary[1] or boundary[3]:
                    self.save()
                if boundary[2] or boundary[3]:
                    self._print_progress(record, *rate_from)
                self._maybe_stop()
                self._last_done = time.time()  # the next step's time excludes this work
        if pending is not None:
            record = self._complete(*pending)
        self.log.finish("succeeded")
        return {"step": self.step, **record}

    def _enter_stage(self) -> None:
        """The model under the stage's model settings (a changed RoPE retraces the step);
        at a stage's first step: say so (once, even across a resume) and, for
        `optimizer: fresh`, start new AdamW moments (the LR keeps the run's step)."""
        stage = self.plan.at(self.step)
        if self.model.cfg != stage.model:  # its RoPE: from its first step, or on resume
            # the AdamW moments are model-shaped trees: they carry the config too
            swap = lambda node: (with_model_config(node, stage.model)
                                 if isinstance(node, Transformer) else node)
            self.model, self.opt_state = jax.tree.map(
                swap, (self.model, self.opt_state), is_leaf=lambda n: isinstance(n, Transformer))
        if (stage.short_rows, stage.short_len) != self._step_cut:  # the stage's short windows
            self.train_step = make_train_step(stage_config(self.cfg, stage), self.optimizer)
            self._step_cut = (stage.short_rows, stage.short_len)
        if not self.plan.staged or stage.start != self.step:
            return
        if self.plan.fresh_optimizer_at(self.step):
            self.opt_state = self._fresh_opt_state(self.step)
        message = stage.summary()
        if not any(e.get("kind") == "stage" and e.get("message") == message
                   for e in self.log.events.read()):
            self.log.event(self.step, "stage", message)
            print(message, flush=True)

    def _complete(self, step: int, parts: dict, evaluate: bool = False) -> dict:
        """Fetch step `step`'s metrics (waiting for it to finish), check and log them."""
        parts = jax.device_get(parts)
        now = time.time()
        stage = self.plan.at(step - 1)
        tokens_per_s = stage.batch_size * stage.seq_len / (now - self._last_done)
        self._last_done = now
        record = self._record(parts, self.lr(step - 1), tokens_per_s, stage)
        self._check_finite(step, record)
        self._flag_spikes(step, record)
        self.overfit.step(record["ce"])
        self._check_health(step, parts, record)
        if evaluate:
            record.update(self.evaluate())
            self._flag_overfit(step, record, stage)
        self.log.step(step, record)
        return record

    def _record(self, parts: dict, lr: float, tokens_per_s: float, stage: Stage) -> dict:
        record = {k: float(parts[k]) for k in
                  ("loss", "ce", "aux_loss", "seq_aux_loss", "router_z", "logit_z",
                   "grad_norm")}
        record.update({k: float(v) for k, v in parts.items() if k.startswith(MTP_LOSS_PREFIX)})
        record.update(lr=float(lr), tokens_per_s=tokens_per_s,
                      mfu=mfu(stage_config(self.cfg, stage), tokens_per_s))
        if self.plan.staged:  # the stage and the mixture it actually draws (normalized)
            record["stage"] = stage.index
        if self.plan.staged and isinstance(self.loader, StagedLoader):  # not conversations
            weights = self.loader.weights[stage.index]
            record.update({f"mixture/{s}": float(w) for s, w in
                           zip(self.loader.sources, weights, strict=True)})
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

    def _repeated(self, step: int) -> set[str] | None:
        """The sources passed over more than once by `step` (the plan's passes, linear
        within a stage); None where they are not counted (conversations) or counted per
        cell rather than per source."""
        if self.passes is None or not set(self.loader.sources) <= set(
                self.passes[0]["cumulative"]):
            return None
        before: dict[str, float] = {}
        for st in self.passes:
            if step <= st["end"]:
                frac = (step - st["start"]) / max(st["end"] - st["start"], 1)
                now = {n: before.get(n, 0.0) + p * frac for n, p in st["passes"].items()}
                return {n for n, p in now.items() if p > 1.0}
            before = dict(st["cumulative"])
        return {n for n, p in before.items() if p > 1.0}

    def _flag_overfit(self, step: int, record: dict, stage: Stage) -> None:
        """The train-validation gap (the validation loss weighted as the stage draws its
        sources, minus the mean training CE since the last evaluation) and an `overfit`
        event for each source whose validation loss rose over the last evaluations while
        the training loss fell (spikes.OverfitDetector)."""
        val = {k.removeprefix(LOSS_PREFIX): v for k, v in record.items()
               if k.startswith(LOSS_PREFIX)}
        train, sources = self.overfit.evaluate(val, self._repeated(step))
        if train is None:
            return
        weights = source_weights(self.loader.meta, stage.mixture)
        record["train_val_gap"] = sum(w * val[s] for s, w in weights.items() if s in val) - train
        for source in sources:
            first, k = self.overfit.history[0], self.overfit.evals  # the span's start
            message = (f"{LOSS_PREFIX}{source} rose at each of the last {k} evaluations "
                       f"({first[1][source]:.4g} -> {val[source]:.4g}) while the training "
                       f"loss fell ({first[0]:.4g} -> {train:.4g}): overfitting")
            self.log.event(step, "overfit", message)
            record[f"overfit/{source}"] = 1.0

    def _check_health(self, step: int, parts: dict, record: dict) -> None:
        """Dead experts per MoE layer (train/health.py), and an event when one dies or
        revives."""
        if "tokens_per_expert" not in parts:  # a dense model
            return
        for kind, message in self.health.update(parts["tokens_per_expert"]):
            self.log.event(step, kind, message)
        for i, dead in enumerate(self.health.dead()):
            record[f"{DEAD_METRIC}/layer_{i}"] = float(dead)

    def _maybe_fault(self) -> None:
        if os.environ.get(FAULT_ENV) == str(self.step):
            os.kill(os.getpid(), signal.SIGKILL)

    def _print_progress(self, record: dict, since: float, first: int) -> None:
        """One line per log step. The ETA's rate counts from the first compiled step
        (`since`, `first`): with the compile in it, the first ETA was 3x the real time."""
        per_step = (time.time() - since) / max(self.step - first, 1)
        eta = per_step * (self.cfg.train.steps - self.step)
        vals = " ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in record.items()
                        if k.startswith("val_loss/"))
        print(f"step {self.step}/{self.cfg.train.steps} loss={record['loss']:.4f} "
              f"grad_norm={record['grad_norm']:.3f} tok/s={record['tokens_per_s']:.0f} "
              f"eta={eta:.0f}s" + (f" val {vals}" if vals else ""), flush=True)


def train(cfg: Config, run_dir: str | Path, experiment: str | None = None,
          allow_config_change: bool = False, match_experiment: bool = False,
          evaluator: Evaluator | None = None, parent: Parent | None = None) -> dict:
    """Train (or resume) the run in `run_dir`; returns the last step's metrics.

    Holds the run dir's lock throughout (a second trainer is refused) and turns
    SIGTERM/SIGINT into a checkpoint and `errors.Interrupted`. `match_experiment`: the
    config must be the experiment's snapshot (`moelab train --experiment`; a ladder's
    experiment holds many rungs' configs, so it does not ask for this). `evaluator`
    replaces the sampled validation (the ladder scores the whole val split). `parent`:
    a new run starts from another run's checkpoint (a branch).
    """
    run_dir = Path(run_dir)
    fresh = not run_dir.exists()
    try:
        # Refusals first, before the run dir, its lock or the corpus exist: a refused
        # start leaves nothing behind. The corpus is prepared outside StopRequest, whose
        # "finish this step" has no step to finish there.
        check_identity(run_dir, cfg, allow_config_change)
        check_dispatch(cfg)  # its registry entry's mesh checks
        if experiment and match_experiment:
            check_snapshot(run_dir, experiment, config_to_dict(cfg), allow_config_change)
        prepared_data(cfg)
        keep_freed_memory()  # each step reuses the last one's pages (train/memory.py)
        with RunDirLock(run_dir), StopRequest() as stop:
            return Trainer(cfg, run_dir, experiment, allow_config_change, stop,
                           match_experiment, evaluator, parent).run()
    except (UserError, FileNotFoundError) as err:
        if fresh and not _has_trained(run_dir):
            # refused by a later check (memory, mesh): the start created the run dir,
            # so nothing in it is anyone else's and nothing of the run is lost
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(err, UserError):
            raise
        raise UserError(str(err)) from err


def _has_trained(run_dir: Path) -> bool:
    """Whether the run dir holds anything of a run: a checkpoint or a logged step."""
    metrics = run_dir / METRICS_FILE
    return any(run_dir.glob(f"{CHECKPOINT_DIR}/*")) or (metrics.is_file()
                                                        and metrics.stat().st_size > 0)
