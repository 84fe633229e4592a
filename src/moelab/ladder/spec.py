"""Ladder specs: a few small rungs at rising compute and one target to predict.

A spec is YAML:

    name: default                 # optional; default: the file's stem
    out: runs/ladder/default      # optional; default: runs/ladder/<name>
    base: {data: ..., optim: ...} # a partial config applied to every rung and the target
                                  # (with `stages:`, every run runs that plan at the same
                                  # fractions of its steps; see moelab.config.plan)
    seeds: [1, 2, 3]              # optional: every rung is trained once per seed
    evals: 10                     # optional: scored on the whole val split every 1/evals
    rungs:
      - {name: w32, model: {d_model: 32}, train: {steps: 1000}, branches: [500, 750]}
      - ...
    target: {name: target, model: {d_model: 160}, train: {steps: 2000}}
    lr_check: {rungs: [w32, w96], factors: [0.5, 2.0]}  # optional
    lr_horizon: {tokens: 1228800, power: 0.3}           # optional (below)
    fit: {bootstrap: 1000, confidence: 0.9, seed: 0}    # optional

Each rung's sections override base's field by field (a rung's data.mixture replaces
base's whole). Every run goes through config_from_dict, so a bad field fails here, before
anything trains. Compute is C = flops_per_token(cfg) * steps * batch_size * seq_len.

A rung is a *point* (one (N, D)); with `seeds` it is trained once per seed (train.seed and
data.seed both set: init and data order vary, the val split scored stays the same), as runs
`<point>-s<seed>`, and the fit uses the point's mean and the pooled seed sd. `branches` are
WSD cooldowns: a branch of L steps resumes the rung's run from its checkpoint at the step
where an L-step WSD run would start decaying, and decays from there, so it *is* an L-step
run (same warmup, lr and batches up to that step) that costs only its decay. Rungs may
share a compute level (IsoFLOP grids) and need no order.

`lr_horizon` scales each run's LR with the tokens it trains: optim.lr * (tokens / T) **
-power, T = `lr_horizon.tokens` (the horizon at which base's lr was chosen), tokens = steps x
batch_size x seq_len of that run. The optimum LR falls as runs get longer (Bjorck et al.
2024; Marin's fitted rule has adam_lr ~ tokens^-0.28), and a ladder's target trains several
times the tokens of its longest rung; bench/horizon_transfer.py measures the power. The
rule sets each run's optim.lr (printed by `moelab ladder plan`, kept in its config.yaml);
a cooldown branch keeps its trunk's, since it is that run up to its branch step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelab.config import Config, ConfigError, config_from_dict, config_to_dict, preset_or_file
from moelab.ladder.fit import CURVE_FORMS
from moelab.ladder.overfit import NAMES as OVERFIT_PARAMS
from moelab.schema import brief, read_yaml
from moelab.train.metrics import active_params, flops_per_token, total_params
from moelab.train.optimizer import width_factor

MIN_POINTS = 3  # L(C) has three parameters; more points leave residuals to check it by
MIN_TARGET_RATIO = 8.0  # the target's compute over the largest rung's, at least
SPEC_KEYS = {"name", "out", "base", "seeds", "evals", "rungs", "target", "lr_check", "fit",
             "lr_horizon"}
REPETITION = ("muennighoff", "none", "measured")  # fit.repetition's values
RUNG_KEYS = {"name", "seeds", "branches"}  # besides config sections
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a rung's name is its run directory


@dataclass(frozen=True)
class FitOptions:
    bootstrap: int = 1000  # parametric-bootstrap resamples for the interval
    confidence: float = 0.9  # two-sided coverage of the interval
    seed: int = 0  # of the bootstrap's resampling
    noise_sd: float | None = None  # per-run seed sd (nats) when the spec has no replicates
    # whose value is the prediction: chinchilla | compute | curve | backtest (the law with
    # the smallest extrapolation error in the rungs' backtests; needs misspecification)
    law: str = "chinchilla"
    # the whole-curve law's form (moelab.ladder.curve): "q" (chosen by the rung-only
    # backtests of bench/curve_law_study.py) or "tissue" (Tissue et al. 2024's)
    curve_law: str = "q"
    # the law whose value is the prediction at the end of every stage but the last (null:
    # `law`): chinchilla | compute | curve
    stage_law: str | None = None
    # repeated data: "muennighoff" counts tokens past one pass over the corpus at what they
    # are worth (moelab.ladder.curve.REPEAT_DECAY) in L(N, D)'s D and the curve law's S1;
    # "none" counts every token the same; "measured": the prediction is the law that can
    # rise with passes (moelab.ladder.overfit), fitted on the rungs themselves, so some rungs
    # must repeat the target's corpus (trained for 2 to 16 passes over it); the other laws
    # still count repeats by "muennighoff"
    repetition: str = "muennighoff"
    # true: the end of every stage after the first is the previous stage end's value times
    # one minus the stage's relative loss gain, which every rung measures at the same
    # fractions (linear in ln N and ln D; predict._stage_gain); it is then also the final
    # prediction. false: each stage end by its own law (stage_law; the last by `law`)
    stage_gain: bool = False
    # what is fitted and predicted: "loss" (CE, mixture-weighted over sources) or
    # "bpb_macro" (bits per byte, every source weighing the same; tokenizer-independent)
    metric: str = "loss"
    # true: pre-register a target that passes over some source more often than every rung
    # did (and more than once), a regime the rungs never measured; false: refuse it
    # (moelab.ladder.repetition)
    accept_repetition: bool = False
    # true: every law's interval adds a misspecification term estimated from the ladder's
    # own extrapolating backtests, scaled by the target's distance past the top compute
    # level (moelab.ladder.misspec), and the record states the backtests' coverage and
    # whether the laws disagree by more than the interval; `law: backtest` then picks the
    # law with the smallest backtest error rate. With repetition: measured, the measured
    # law's interval adds the same term from its own refits with each compute level left
    # out (its error in form). false: seed noise only (specs before it). A spec with
    # repetition: measured defaults to true (MEASURED_DEFAULTS)
    misspecification: bool = False
    # fit.repetition: measured only: the largest residual sd of the repetition law on its
    # own rungs, relative to their mean loss, at which the target is pre-registered. A law
    # that misses the points it was fitted on by more than the 2% a ladder's prediction is
    # held to cannot be expected to land within it at an extrapolated target, so past this
    # the pre-registration refuses (null: no check)
    max_rung_residual: float | None = 0.02
    # fit.repetition: measured only: the relative error a prediction is held to. The target
    # is refused when its own interval gives it less than even odds of landing that close
    # (the interval read as a normal one: half-width at fit.confidence over
    # z((1 + confidence) / 2), times z(0.75), above this fraction of the value), since the
    # law then says itself it cannot predict to that precision (null: no check)
    precision: float | None = 0.02
    # fit.repetition: measured only: the odds the interval must give of landing within
    # fit.precision (0.5: even odds, as since fit.precision was added; 0.9 with a 90%
    # interval asks for a half-width under fit.precision itself); a spec with repetition:
    # measured defaults to 0.9 (MEASURED_DEFAULTS)
    precision_odds: float = 0.5
    # fit.repetition: measured only: refuse a target the rungs do not pin. With fewer than
    # three token counts (or widths) among the rungs, the law's data term B (D/D0)^-b (or
    # A (N/N0)^-a) has three parameters for two values, so E, B and b trade off exactly:
    # the rungs' losses cannot tell them apart while a target at another D moves with
    # them, and the value then depends on where the optimiser stops. Refused before any
    # rung trains by that count (moelab.ladder.repetition), and after the fit by any
    # direction of the parameters the rungs leave flat that moves the target
    # (OverfitFit.unpinned). false: no check (specs before it); a spec with repetition:
    # measured defaults to true (MEASURED_DEFAULTS)
    require_identified: bool = False


# A spec with fit.repetition: measured defaults to these (its own keys win). The measured
# law's delta-method interval counts the parameters' noise, not its error in form:
# repetition_v5 landed +1.76% outside its +-0.75%, and with the form-error term v7
# pre-registered +-3.96% at even odds within 1.62% and missed 2% (+3.14%). With both,
# v5 and v7 are refused and v6 (+-1.67%, landed +0.91%) pre-registers
# (bench/repetition_form_error.py). Chosen after those results; repetition_v8, which set
# both before it ran, is their first test. FitOptions itself keeps the old defaults, so
# every committed record reproduces from its own fit_options. fit.require_identified came
# after v2-v9 all trained their rungs at two token counts (repetition_v10 is its first
# test).
MEASURED_DEFAULTS = {"misspecification": True, "precision_odds": 0.9,
                     "require_identified": True}


def run_tokens(config: Config) -> int:
    """The tokens a run of `config` trains: steps x batch_size x seq_len."""
    return config.train.steps * config.data.batch_size * config.data.seq_len


@dataclass(frozen=True)
class Rung:
    """One run of the ladder (a rung's replicate, a cooldown branch, an lr probe, the target)."""

    name: str  # its run directory
    config: Config
    point: str = ""  # the (N, D) point it measures; replicates share it ("" = its name)
    parent: str | None = None  # a branch: the run whose checkpoint it starts from
    branch_step: int = 0  # ... and that checkpoint's step (where the decay starts)

    @property
    def tokens(self) -> int:
        return run_tokens(self.config)

    @property
    def compute(self) -> float:
        return flops_per_token(self.config) * self.tokens

    @property
    def active_params(self) -> int:
        return active_params(self.config)

    @property
    def total_params(self) -> int:
        return total_params(self.config)

    @property
    def seed(self) -> int:
        return self.config.train.seed

    def summary(self) -> dict[str, Any]:
        m, moe = self.config.model, self.config.moe
        return {"name": self.name, "point": self.point or self.name, "seed": self.seed,
                "parent": self.parent, "branch_step": self.branch_step,
                "d_model": m.d_model, "n_layers": m.n_layers,
                "n_experts": moe.n_experts, "top_k": moe.top_k, "d_ff": m.d_ff,
                "steps": self.config.train.steps, "batch_size": self.config.data.batch_size,
                "lr": self.config.optim.lr,
                "matrix_lr": self.config.optim.lr * width_factor(self.config.optim, m.d_model),
                "warmup_steps": self.config.optim.warmup_steps,
                "active_params": self.active_params, "total_params": self.total_params,
                "tokens": self.tokens, "compute": self.compute}


@dataclass(frozen=True)
class LadderSpec:
    name: str
    out: Path
    rungs: tuple[Rung, ...]  # every run the fit uses: replicates and branches included
    target: Rung
    fit: FitOptions
    lr_runs: tuple[Rung, ...] = ()  # the learning-rate check's extra runs
    evals: int = 10

    def runs(self) -> tuple[Rung, ...]:
        """In training order: a branch after its parent, the target last."""
        return (*self.rungs, *self.lr_runs, self.target)

    def points(self) -> dict[str, list[Rung]]:
        """{point: its replicate runs}, in spec order."""
        out: dict[str, list[Rung]] = {}
        for r in self.rungs:
            out.setdefault(r.point or r.name, []).append(r)
        return out


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """base with override's sections merged in, field by field (two levels deep); a
    section that is a list (`stages`) is replaced whole."""
    merged = {name: dict(fields) if isinstance(fields, dict) else fields
              for name, fields in base.items()}
    for name, fields in override.items():
        if isinstance(fields, dict) and isinstance(merged.get(name), dict):
            merged[name].update(fields)
        else:
            merged[name] = fields
    return merged


def _config(raw: dict[str, Any], base: dict[str, Any], where: str, name: str) -> Config:
    try:
        return config_from_dict(merge(base, raw))
    except ConfigError as err:
        raise ConfigError(f"{where} ({name}): {err}") from err


@dataclass(frozen=True)
class Horizon:
    """`lr_horizon`: the LR of a run of `tokens` tokens is lr * (tokens / self.tokens) **
    -self.power (see the module docstring)."""

    tokens: int
    power: float

    def apply(self, config: Config) -> Config:
        factor = (run_tokens(config) / self.tokens) ** -self.power
        return dataclasses.replace(config, optim=dataclasses.replace(
            config.optim, lr=config.optim.lr * factor))


def _horizon(raw: Any) -> Horizon | None:
    if raw is None:
        return None
    where = "lr_horizon"
    if not isinstance(raw, dict) or set(raw) != {"tokens", "power"}:
        raise ConfigError(f"{where}: expected {{tokens: T, power: p}} (the horizon base lr was "
                          f"chosen at, and the LR's power in tokens), got {brief(raw)}")
    tokens, power = raw["tokens"], raw["power"]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ConfigError(f"{where}.tokens: a positive integer (tokens), got {brief(tokens)}")
    if not isinstance(power, int | float) or isinstance(power, bool) or not 0 <= power <= 1:
        raise ConfigError(f"{where}.power: a number in [0, 1] (the LR falls as "
                          f"tokens^-power), got {brief(power)}")
    return Horizon(tokens, float(power))


def _int_list(raw: Any, where: str, minimum: int = 0) -> list[int]:
    if not isinstance(raw, list) or not raw or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in raw):
        raise ConfigError(f"{where}: expected a non-empty list of integers >= {minimum}, "
                          f"got {brief(raw)}")
    if len(set(raw)) != len(raw):
        raise ConfigError(f"{where}: {raw!r} lists a value twice")
    return list(raw)


def _ladder_fields(config: Config, evals: int, seed: int | None, checkpoint_every: int | None,
                   where: str) -> Config:
    """The fields the ladder owns: seeds, evaluation points and (for trunks) checkpoints.
    A staged trunk is also evaluated at its branches' steps (checkpoint_every divides
    them): that is where a branch's first stage ends, and the branch trains only after."""
    t = config.train
    every = max(t.steps // evals, 1)
    if checkpoint_every is not None and config.stages:
        every = checkpoint_every
    fields: dict[str, dict[str, Any]] = {"train": {"eval_every": every}}
    if seed is not None:
        fields["train"]["seed"] = seed
        fields["data"] = {"seed": seed}
    if checkpoint_every is not None:
        fields["train"].update(checkpoint_every=checkpoint_every,
                               keep_checkpoints=t.steps // checkpoint_every + 1)
    try:
        return config_from_dict(merge(config_to_dict(config), fields))
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err


def stable_end(config: Config) -> int:
    """The last step of a WSD run's constant-lr phase (where its decay starts)."""
    steps = config.train.steps
    return steps - max(int(round(config.optim.decay_fraction * steps)), 0)


def _branch_starts(config: Config, branches: list[int], where: str) -> dict[int, int]:
    """{branch length: its start step}, checked against the trunk's schedule."""
    o, steps = config.optim, config.train.steps
    if branches and o.schedule != "wsd":
        raise ConfigError(f"{where}.branches: cooldown branches need optim.schedule wsd, "
                          f"got {o.schedule!r}")
    starts = {}
    for length in branches:
        probe = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                      steps=length))
        start = stable_end(probe)
        if not (o.warmup_steps < start and length < steps and start <= stable_end(config)):
            raise ConfigError(
                f"{where}.branches: a {length}-step branch would start decaying at step "
                f"{start}, which must lie after warmup ({o.warmup_steps}) and inside the "
                f"rung's stable phase (up to step {stable_end(config)} of {steps}); "
                "choose shorter branches or a longer rung")
        plans = (config.plan, probe.plan)
        before = [[b for b in plan.starts() if b < start] for plan in plans]
        if before[0] != before[1]:
            raise ConfigError(
                f"{where}.branches: a {length}-step branch starts at step {start} from the "
                f"rung's checkpoint, but its stages would switch at steps {before[1]} before "
                f"that and the rung's at {before[0]}: the branch would not be the {length}-"
                "step run it stands for; place the stage switches at or after the decay "
                "start (e.g. start: 0.8 with decay_fraction 0.2), or drop the branches")
        starts[length] = start
    return starts


def _expand_rung(raw: Any, base: dict[str, Any], where: str, default_name: str,
                 seeds: list[int] | None, evals: int,
                 horizon: Horizon | None = None) -> list[Rung]:
    """A rung's runs: one per seed, each followed by its cooldown branches."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of config sections, got {brief(raw)}")
    raw = dict(raw)
    name = raw.pop("name", default_name)
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"{where}.name: {name!r} must be a plain directory name "
                          "(letters, digits, '_', '-', '.')")
    if "seeds" in raw:
        seeds = _int_list(raw.pop("seeds"), f"{where}.seeds")
    branches = _int_list(raw.pop("branches"), f"{where}.branches", 1) if "branches" in raw else []
    bad = sorted(k for k, v in raw.items() if not isinstance(v, dict))
    if bad:
        raise ConfigError(f"{where} ({name}): {bad} must be config sections (mappings); "
                          f"a rung's other keys are {sorted(RUNG_KEYS)}")
    config = _config(raw, base, where, name)
    if horizon is not None:  # before the branches, which keep their trunk's LR
        config = horizon.apply(config)
    starts = _branch_starts(config, sorted(branches), f"{where} ({name})")
    every = math.gcd(*starts.values(), max(config.train.steps // evals, 1)) if starts else None
    runs = []
    for seed in seeds or [None]:
        suffix = "" if seeds is None else f"-s{seed}"
        trunk = Rung(name + suffix, _ladder_fields(config, evals, seed, every, where), name)
        runs.append(trunk)
        for length, start in starts.items():
            point = f"{name}-b{length}"
            branch = dataclasses.replace(trunk.config, train=dataclasses.replace(
                trunk.config.train, steps=length))
            runs.append(Rung(point + suffix, _ladder_fields(branch, evals, seed, None, where),
                             point, trunk.name, start))
    return runs


def _fit_options(raw: Any) -> FitOptions:
    if raw is None:
        return FitOptions()
    if not isinstance(raw, dict):
        raise ConfigError(f"fit: expected a mapping, got {brief(raw)}")
    names = {f.name for f in dataclasses.fields(FitOptions)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"fit: unknown key(s) {unknown}; valid keys are {sorted(names)}")
    if raw.get("repetition") == "measured":  # a spec's defaults for the measured law
        raw = {**MEASURED_DEFAULTS, **raw}
    options = FitOptions(**raw)
    if not isinstance(options.bootstrap, int) or options.bootstrap < 10:
        raise ConfigError(f"fit.bootstrap: must be an integer >= 10, got {options.bootstrap!r}")
    if not 0 < options.confidence < 1:
        raise ConfigError(f"fit.confidence: must be in (0, 1), got {options.confidence!r}")
    if options.metric not in ("loss", "bpb_macro"):
        raise ConfigError(f"fit.metric: {options.metric!r} is not one of ['loss', 'bpb_macro']")
    laws = ("chinchilla", "compute", "curve")
    if not isinstance(options.misspecification, bool):
        raise ConfigError(f"fit.misspecification: must be true or false, got "
                          f"{options.misspecification!r}")
    if options.law == "backtest" and not options.misspecification:
        raise ConfigError("fit.law: backtest chooses by the misspecification backtests; set "
                          "fit.misspecification: true, or name the law")
    if options.law not in (*laws, "backtest"):
        raise ConfigError(f"fit.law: {options.law!r} is not one of {[*laws, 'backtest']}")
    if options.stage_law is not None and options.stage_law not in laws:
        raise ConfigError(f"fit.stage_law: {options.stage_law!r} is not one of {list(laws)}")
    if not isinstance(options.stage_gain, bool):
        raise ConfigError(f"fit.stage_gain: must be true or false, got {options.stage_gain!r}")
    if not isinstance(options.require_identified, bool):
        raise ConfigError(f"fit.require_identified: must be true or false, got "
                          f"{options.require_identified!r}")
    if not isinstance(options.accept_repetition, bool):
        raise ConfigError(f"fit.accept_repetition: must be true or false, got "
                          f"{options.accept_repetition!r}")
    if options.repetition not in REPETITION:
        raise ConfigError(f"fit.repetition: {options.repetition!r} is not one of "
                          f"{list(REPETITION)}")
    if options.curve_law not in CURVE_FORMS:
        raise ConfigError(f"fit.curve_law: {options.curve_law!r} is not one of "
                          f"{sorted(CURVE_FORMS)}")
    if options.noise_sd is not None and not (
            isinstance(options.noise_sd, int | float) and options.noise_sd > 0):
        raise ConfigError(f"fit.noise_sd: must be a number > 0, got {options.noise_sd!r}")
    for key in ("max_rung_residual", "precision"):  # fractions of the loss, or no check
        value = getattr(options, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 < value < 1):
            raise ConfigError(f"fit.{key}: must be a fraction in (0, 1) or null, got "
                              f"{value!r}")
    odds = options.precision_odds
    if isinstance(odds, bool) or not isinstance(odds, int | float) or not 0 < odds < 1:
        raise ConfigError(f"fit.precision_odds: must be a probability in (0, 1), got {odds!r}")
    return options


def _lr_runs(raw: Any, rungs: tuple[Rung, ...]) -> tuple[Rung, ...]:
    """lr_check: each named rung's first seed again at lr * factor (no branches)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or set(raw) != {"rungs", "factors"}:
        raise ConfigError(f"lr_check: expected {{rungs: [names], factors: [numbers]}}, "
                          f"got {brief(raw)}")
    factors = raw["factors"]
    if not isinstance(factors, list) or not factors or not all(
            isinstance(f, int | float) and f > 0 and f != 1 for f in factors):
        raise ConfigError(f"lr_check.factors: expected positive numbers other than 1, "
                          f"got {factors!r}")
    trunks = {}
    for r in rungs:
        if r.parent is None:
            trunks.setdefault(r.point, r)
    runs = []
    for point in raw["rungs"] if isinstance(raw["rungs"], list) else [raw["rungs"]]:
        if point not in trunks:
            raise ConfigError(f"lr_check.rungs: {point!r} is not a rung; rungs are "
                              f"{sorted(trunks)}")
        for f in factors:
            cfg = trunks[point].config
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                     lr=cfg.optim.lr * f))
            runs.append(Rung(f"{point}-lr{f:g}", cfg, f"{point}-lr{f:g}"))
    return tuple(runs)


def validate_compute(rungs: tuple[Rung, ...], target: Rung) -> None:
    """Enough distinct points; unique names; the target MIN_TARGET_RATIO x beyond every rung."""
    names = [r.name for r in (*rungs, target)]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"rungs: names {duplicates} are used twice; each run needs its own "
                          "directory, rename them")
    points = {r.point or r.name for r in rungs}
    if len(points) < MIN_POINTS:
        raise ConfigError(f"rungs: the law L(C) = E + A*C^-alpha has 3 parameters and needs at "
                          f"least {MIN_POINTS} distinct points (rungs or branches), got "
                          f"{len(points)}")
    if len({round(math.log(r.compute), 3) for r in rungs}) < 2:
        raise ConfigError("rungs: every rung has the same compute; a ladder needs at least "
                          "two compute levels to extrapolate from")
    top = max(rungs, key=lambda r: r.compute)
    high = top.compute
    if target.compute < MIN_TARGET_RATIO * high:
        raise ConfigError(
            f"target ({target.name}): compute {target.compute:.3g} FLOPs is only "
            f"{target.compute / high:.2f}x the largest rung ({top.name}, {high:.3g}); it "
            f"must be at least {MIN_TARGET_RATIO:g}x: raise the target's train.steps or size, "
            "or shrink the rungs")


def spec_from_dict(raw: Any, name: str, out: str | Path | None = None) -> LadderSpec:
    """Build and validate a spec; `out` overrides the spec's own out."""
    if not isinstance(raw, dict):
        raise ConfigError(f"ladder spec: expected a mapping at the top level, got {brief(raw)}")
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise ConfigError(f"ladder spec: unknown key(s) {unknown}; valid keys are "
                          f"{sorted(SPEC_KEYS)}")
    name = raw.get("name", name)
    base = raw.get("base") or {}
    if not isinstance(base, dict) or not all(isinstance(v, list if k == "stages" else dict)
                                             for k, v in base.items()):
        raise ConfigError("base: expected a mapping of config sections (model, data, ...) "
                          "and optionally `stages`, a list applied to every run at the same "
                          "fractions of its steps")
    evals = raw.get("evals", 10)
    if not isinstance(evals, int) or isinstance(evals, bool) or not 1 <= evals <= 100:
        raise ConfigError(f"evals: evaluation points per run, an integer in [1, 100], "
                          f"got {evals!r}")
    seeds = _int_list(raw["seeds"], "seeds") if "seeds" in raw else None
    rungs_raw = raw.get("rungs")
    if not isinstance(rungs_raw, list):
        raise ConfigError("rungs: expected a list of rungs, each a mapping of config sections")
    if "target" not in raw:
        raise ConfigError("target: missing; the ladder needs one target run to predict")
    horizon = _horizon(raw.get("lr_horizon"))
    rungs = tuple(run for i, r in enumerate(rungs_raw)
                  for run in _expand_rung(r, base, f"rungs[{i}]", f"rung{i + 1}", seeds, evals,
                                          horizon))
    target_raw = raw["target"]
    if not isinstance(target_raw, dict):
        raise ConfigError(f"target: expected a mapping of config sections, got {target_raw!r}")
    target_raw = dict(target_raw)
    target_name = target_raw.pop("name", "target")
    if not isinstance(target_name, str) or not NAME.match(target_name):
        raise ConfigError(f"target.name: {target_name!r} must be a plain directory name")
    target_cfg = _config(target_raw, base, "target", target_name)
    if horizon is not None:
        target_cfg = horizon.apply(target_cfg)
    target = Rung(target_name, _ladder_fields(target_cfg, evals, seeds[0] if seeds else None,
                                              None, "target"), target_name)
    validate_compute(rungs, target)
    lr_runs = _lr_runs(raw.get("lr_check"), rungs)
    fit = _fit_options(raw.get("fit"))
    if fit.repetition == "measured" and len(spec_points := {r.point for r in rungs}) < len(
            OVERFIT_PARAMS):
        raise ConfigError(f"fit.repetition: measured fits a law of {len(OVERFIT_PARAMS)} "
                          f"parameters and needs as many rung points, got {len(spec_points)}; "
                          "add rungs (e.g. one width at 1, 2, 4, 8 and 16 passes over the corpus)")
    if fit.repetition == "measured" and (paths := sorted(
            {r.config.data.path for r in rungs} - {target.config.data.path})):
        raise ConfigError(f"fit.repetition: measured compares the rungs' losses with the "
                          f"target's, so they must share its corpus ({target.config.data.path}"
                          f"), but rungs train on {paths}: another corpus has its own "
                          "tokenizer and val split; repeat data by training longer instead")
    if fit.stage_gain and not target.config.plan.staged:
        raise ConfigError("fit.stage_gain: the plan has one stage, so there is no stage gain "
                          "to fit; add `stages:` to base, or drop stage_gain")
    return LadderSpec(name=name, out=Path(out or raw.get("out") or Path("runs/ladder") / name),
                      rungs=rungs, target=target, fit=fit, lr_runs=lr_runs, evals=evals)


# The ladder presets are the specs in the repository's configs/ladder/ (they name their
# committed results), found beside the source tree: a checkout installed with `pip install
# -e .`, as the README's set-up does. A name that is not a file is looked up there, in its
# dev/ (the specs methods are chosen on) and heldout/ (written before they ran) folders.
LADDER_PRESETS = Path(__file__).resolve().parents[3] / "configs" / "ladder"


def load_spec(path: str | Path, out: str | Path | None = None) -> LadderSpec:
    """A ladder spec from a YAML file or a preset name (`default` is
    configs/ladder/dev/default.yaml, see LADDER_PRESETS)."""
    found = [*LADDER_PRESETS.glob("*.yaml"), *LADDER_PRESETS.glob("*/*.yaml")]
    presets = {p.stem: p for p in sorted(found)}
    path = preset_or_file(path, presets, "ladder spec")
    if not path.is_file():
        raise ConfigError(f"ladder spec {path} does not exist")
    return spec_from_dict(read_yaml(path, "ladder spec"), path.stem, out)
