"""A run as a plan of stages: pre-training -> mid-training -> ... in one loop.

A stage says where it starts (a fraction of `train.steps` or a step) and what changes from
there: the data mixture, optionally `seq_len` with `batch_size`, the learning rate (the
whole-run schedule continues, or a `restart` begins a new warmup and decay), and whether
the optimizer state is kept (OLMo 3) or started fresh (Delphi). Marin's "switch the data
during the decay" is a stage with only a mixture.

The plan is resolved once from the config into absolute steps, so the trainer, the loader
and the LR schedule all ask it the same question, "which stage is step s in?", and a
batch stays a pure function of (seed, step). This module is pure Python (no jax), so the
config can build and check it before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from moelab.errors import ConfigError

if TYPE_CHECKING:
    from moelab.config import Config

# Model fields a stage may change: the RoPE scaling and the attention-logit multiplier of a
# long-context stage. None of them shapes a parameter, so the checkpoint stays loadable
# across the stage; the rotary tables are computed from the config at trace time, so the
# stage's step (a recompile at its start) uses them from its first update.
STAGE_MODEL_FIELDS: tuple[str, ...] = ("rope_theta", "rope", "attn_logit_scale",
                                     "attention_impl", "attention_chunk")


@dataclass(frozen=True)
class RestartConfig:
    """A new LR schedule from the stage's start to the next restart (or the run's end)."""

    warmup: int = 0  # steps of linear warmup up to the stage's peak
    peak_fraction: float = 1.0  # the stage's peak LR = optim.lr * peak_fraction
    decay: Literal["linear", "cosine", "constant"] = "linear"  # after the warmup
    min_lr_ratio: float | None = None  # end LR / the stage's peak; null = optim.min_lr_ratio


@dataclass(frozen=True)
class StageConfig:
    """One stage of `stages:`; fields left at their default keep the run's setting."""

    # Where it starts: a float in [0, 1) is a fraction of train.steps, an int is a step.
    start: int | float = 0
    name: str = ""
    mixture: dict[str, float] = field(default_factory=dict)  # source -> weight; {} = data.mixture
    # 0 = data.seq_len. A stage that sets seq_len but not batch_size keeps tokens per step
    # constant: batch_size = data.batch_size * data.seq_len / seq_len (must divide).
    seq_len: int = 0
    batch_size: int = 0  # 0 = data.batch_size (or the token-constant one above)
    # this fraction of each batch's sequences cut into windows of the run's data.seq_len
    # that attend only within themselves (short data kept in a long-context stage)
    short_fraction: float = 0.0
    optimizer: Literal["keep", "fresh"] = "keep"  # fresh: new AdamW moments at the start
    restart: RestartConfig | None = None  # null: the whole-run schedule (optim.*) continues
    # overrides of STAGE_MODEL_FIELDS, from the run's model.* (not the stage before's);
    # rope is a whole section, e.g. {rope: {type: yarn, factor: 8,
    # original_max_position_embeddings: 128}, attn_logit_scale: 1.46}
    model: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """A stage resolved to absolute steps: it trains the updates start .. end-1."""

    index: int
    name: str
    start: int
    end: int
    mixture: dict[str, float]  # {} = proportional to each source's tokens
    seq_len: int
    batch_size: int
    optimizer: str
    restart: RestartConfig | None
    model: Any  # the ModelConfig the stage trains: the run's model.* with its overrides
    short_rows: int = 0  # data.short_rows / short_len as the stage trains
    short_len: int = 0

    @property
    def rows(self) -> int:
        """Sequences the stage trains on: the unit its mixture is apportioned in."""
        return (self.end - self.start) * self.batch_size

    def summary(self) -> str:
        mix = ", ".join(f"{s} {w:g}" for s, w in self.mixture.items()) or "by size"
        lr = ("whole-run schedule" if self.restart is None else
              f"restart (warmup {self.restart.warmup}, peak x{self.restart.peak_fraction:g}, "
              f"{self.restart.decay} decay)")
        rope = self.model.rope
        rope = "" if rope.type == "default" else f", rope {rope.type} x{rope.factor:g}"
        scale = self.model.attn_logit_scale
        scale = "" if scale == 1 else f", attn logit scale {scale:g}"
        short = (f", {self.short_rows} of them cut into windows of {self.short_len}"
                 if self.short_rows else "")
        return (f"stage {self.index}{f' ({self.name})' if self.name else ''}: steps "
                f"{self.start}..{self.end}, mixture {{{mix}}}, seq_len {self.seq_len} x batch "
                f"{self.batch_size}, optimizer {self.optimizer}, lr {lr}{rope}{scale}{short}")


def _start_step(stage: StageConfig, steps: int, where: str) -> int:
    start = stage.start
    if isinstance(start, float):
        if not 0 <= start < 1:
            raise ConfigError(f"{where}.start: a fraction must be in [0, 1) (an int is a step), "
                              f"got {start}")
        return int(round(start * steps))
    if start < 0:
        raise ConfigError(f"{where}.start: must be >= 0, got {start}")
    return start


class Plan:
    """The resolved stages of a run; a run without `stages:` is one stage."""

    def __init__(self, stages: tuple[Stage, ...], steps: int, staged: bool, offset: int = 0):
        self.stages, self.steps, self.staged = stages, steps, staged
        self.offset = offset  # 1 when a "base" stage was put before the declared ones

    def name_of(self, stage: Stage) -> str:
        """The config field naming a stage: `stages[i]` as the user wrote it."""
        return f"stages[{stage.index - self.offset}]" if stage.index >= self.offset else "data"

    def at(self, step: int) -> Stage:
        """The stage that trains update `step` (0-based: the step-th call of the step fn)."""
        for stage in reversed(self.stages):
            if step >= stage.start:
                return stage
        return self.stages[0]

    def starts(self) -> list[int]:
        """The boundary steps: where a stage after the first begins."""
        return [s.start for s in self.stages[1:]]

    def fresh_optimizer_at(self, step: int) -> bool:
        return any(s.start == step and s.optimizer == "fresh" for s in self.stages[1:])

    def lr_segments(self) -> list[tuple[int, int, RestartConfig | None]]:
        """(start, end, restart or None for the whole-run schedule) covering 0..steps."""
        cuts = [s for s in self.stages if s.restart is not None and s.start > 0]
        bounds = [0, *[s.start for s in cuts], self.steps]
        kinds = [self.stages[0].restart, *[s.restart for s in cuts]]
        return [(a, b, r) for a, b, r in zip(bounds, bounds[1:], kinds, strict=False)]

    def started_changes(self, other: Plan, step: int) -> list[str]:
        """Which stages that have started by `step` differ between this plan and `other`
        (their end included: it sets the stage's apportionment and LR decay)."""
        out = []
        for stage in self.stages:
            if stage.start >= step:  # not one update of it trained yet
                continue
            twin = next((s for s in other.stages if s.index == stage.index), None)
            if twin != stage:
                out.append(f"stage {stage.index} (started at step {stage.start})")
        out += [f"new stage {s.index} starting at step {s.start}" for s in other.stages
                if s.index >= len(self.stages) and s.start <= step]
        return out


def build_plan(cfg: Config) -> Plan:
    """Resolve and check `cfg.stages`; every error names the field (`stages[i].x`)."""
    d, steps = cfg.data, cfg.train.steps
    if not cfg.stages:
        only = Stage(0, "", 0, steps, dict(d.mixture), d.seq_len, d.batch_size, "keep", None,
                     cfg.model, d.short_rows, d.short_len)
        return Plan((only,), steps, staged=False)
    raw = list(cfg.stages)
    starts = [_start_step(s, steps, f"stages[{i}]") for i, s in enumerate(raw)]
    if starts[0] > 0:  # the steps before the first declared stage train on the run's data.*
        raw.insert(0, StageConfig(start=0, name="base"))
        starts.insert(0, 0)
    offset = len(raw) - len(cfg.stages)  # to name fields by the user's own indices
    for i, (a, b) in enumerate(zip(starts, starts[1:], strict=False)):
        if b <= a:
            raise ConfigError(f"stages[{i + 1 - offset}].start: stages must be in order and "
                              f"not overlap; step {b} is not after step {a} of the stage before")
    if starts[-1] >= steps:
        raise ConfigError(f"stages[{len(raw) - 1 - offset}].start: step {starts[-1]} is past "
                          f"the end of the run (train.steps={steps})")
    stages = []
    for i, (stage, start) in enumerate(zip(raw, starts, strict=True)):
        where = f"stages[{i - offset}]"
        end = starts[i + 1] if i + 1 < len(raw) else steps
        _check_mixture(stage.mixture, f"{where}.mixture")
        unknown = sorted(set(stage.model) - set(STAGE_MODEL_FIELDS))
        if unknown:
            raise ConfigError(f"{where}.model: {unknown} cannot change per stage (allowed: "
                              f"{list(STAGE_MODEL_FIELDS)})")
        seq_len, batch = _shape(stage, cfg, where)
        model = cfg.model
        if stage.model:  # moelab.config imports this module, so its checker is imported here
            from moelab.config import stage_model

            model = stage_model(cfg.model, stage.model, seq_len, where)
        if stage.optimizer == "fresh" and start == 0:
            raise ConfigError(f"{where}.optimizer: the first stage's optimizer is always fresh; "
                              "'fresh' applies to a later stage")
        if stage.restart is not None:
            _check_restart(stage.restart, end - start, f"{where}.restart")
        short_rows = _short_rows(stage.short_fraction, seq_len, batch, d.seq_len, where)
        stages.append(Stage(i, stage.name, start, end, dict(stage.mixture or d.mixture), seq_len,
                            batch, stage.optimizer, stage.restart, model, short_rows,
                            d.seq_len if short_rows else 0))
    return Plan(tuple(stages), steps, staged=True, offset=offset)


def stage_config(cfg: Config, stage: Stage) -> Config:
    """`cfg` as a stage trains it: its seq_len, batch size and model (RoPE) settings. What
    the memory check, MFU, the step and every reader of a checkpoint of the stage use."""
    data = dataclasses.replace(cfg.data, seq_len=stage.seq_len, batch_size=stage.batch_size,
                               short_rows=stage.short_rows, short_len=stage.short_len)
    return dataclasses.replace(cfg, data=data, model=stage.model)


def _short_rows(fraction: float, seq_len: int, batch: int, run_seq_len: int,
                where: str) -> int:
    """The sequences of a stage's batch that short_fraction cuts into run-length windows."""
    if not (math.isfinite(fraction) and 0 <= fraction < 1):
        raise ConfigError(f"{where}.short_fraction: must be in [0, 1), got {fraction}")
    rows = round(fraction * batch)
    if abs(rows - fraction * batch) > 1e-9:
        raise ConfigError(f"{where}.short_fraction: {fraction} of the stage's {batch} "
                          f"sequences is not a whole number")
    if rows and (seq_len <= run_seq_len or seq_len % run_seq_len):
        raise ConfigError(f"{where}.short_fraction: cuts sequences into windows of "
                          f"data.seq_len={run_seq_len}, so the stage's seq_len ({seq_len}) "
                          "must be a larger multiple of it")
    return rows


def _check_mixture(mixture: dict[str, float], where: str) -> None:
    for source, weight in mixture.items():
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"{where}.{source}: weight must be a finite number >= 0, got "
                              f"{weight}")
    if mixture and sum(mixture.values()) <= 0:
        raise ConfigError(f"{where}: weights must sum to a positive number, got {mixture}")


def _shape(stage: StageConfig, cfg: Config, where: str) -> tuple[int, int]:
    """(seq_len, batch_size) of a stage: tokens per step constant unless both are given."""
    d = cfg.data
    if stage.seq_len < 0 or stage.batch_size < 0:
        raise ConfigError(f"{where}: seq_len and batch_size must be > 0 (0 = the run's)")
    seq_len = stage.seq_len or d.seq_len
    batch = stage.batch_size
    if not batch:
        if (d.batch_size * d.seq_len) % seq_len:
            raise ConfigError(f"{where}.seq_len: {seq_len} does not divide the run's "
                              f"{d.batch_size * d.seq_len} tokens per step; set "
                              f"{where}.batch_size too")
        batch = d.batch_size * d.seq_len // seq_len
    accum = cfg.optim.grad_accum
    shards = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.expert
    if batch % accum or (batch // accum) % shards:
        raise ConfigError(f"{where}.batch_size: {batch} must split into optim.grad_accum={accum} "
                          f"micro-batches over {shards} devices")
    if cfg.moe.pool_size and batch % cfg.moe.pool_size:
        raise ConfigError(f"{where}.batch_size: {batch} must be a multiple of moe.pool_size="
                          f"{cfg.moe.pool_size}")
    return seq_len, batch


def _check_restart(restart: RestartConfig, length: int, where: str) -> None:
    if restart.warmup < 0 or restart.warmup >= length:
        raise ConfigError(f"{where}.warmup: {restart.warmup} must be >= 0 and shorter than its "
                          f"{length} steps")
    if not (math.isfinite(restart.peak_fraction) and restart.peak_fraction > 0):
        raise ConfigError(f"{where}.peak_fraction: must be > 0, got {restart.peak_fraction}")
    ratio = restart.min_lr_ratio
    if ratio is not None and not 0 <= ratio <= 1:
        raise ConfigError(f"{where}.min_lr_ratio: must be in [0, 1], got {ratio}")


def check_sources(plan: Plan, sources: list[str]) -> None:
    """An unknown source in a stage's mixture: checked once the data (its sources) is known."""
    if not plan.staged:
        return
    for stage in plan.stages:
        unknown = sorted(set(stage.mixture) - set(sources))
        if unknown:
            raise ConfigError(f"{plan.name_of(stage)}.mixture: source(s) {unknown} are not in "
                              f"the dataset (its sources: {sources})")
