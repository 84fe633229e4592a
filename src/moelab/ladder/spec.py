"""Ladder specs: a few small rungs at rising compute and one target to predict.

A spec is YAML:

    name: default                 # optional; default: the file's stem
    out: runs/ladder/default      # optional; default: runs/ladder/<name>
    base: {data: ..., optim: ...} # a partial config applied to every rung and the target
    rungs:
      - {name: r1, model: {d_model: 64}, train: {steps: 200}}
      - ...
    target: {name: target, model: {d_model: 160}, train: {steps: 2000}}
    fit: {bootstrap: 1000, confidence: 0.9, seed: 0}   # optional

Each rung's sections override base's field by field (a rung's data.mixture replaces
base's whole). Every rung goes through config_from_dict, so a bad field fails here, before
anything trains. Compute is C = flops_per_token(cfg) * steps * batch_size * seq_len.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moelab.config import Config, ConfigError, config_from_dict
from moelab.train.metrics import active_params, flops_per_token, total_params

MIN_RUNGS = 3  # the law has three parameters; four or more leave residuals for the interval
MIN_TARGET_RATIO = 8.0  # the target's compute over the largest rung's, at least
SPEC_KEYS = {"name", "out", "base", "rungs", "target", "fit"}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a rung's name is its run directory


@dataclass(frozen=True)
class FitOptions:
    bootstrap: int = 1000  # residual-bootstrap resamples for the interval
    confidence: float = 0.9  # two-sided coverage of the interval
    seed: int = 0  # of the bootstrap's resampling


@dataclass(frozen=True)
class Rung:
    """One run of the ladder (a rung or the target) and what it costs."""

    name: str
    config: Config

    @property
    def tokens(self) -> int:
        d = self.config.data
        return self.config.train.steps * d.batch_size * d.seq_len

    @property
    def compute(self) -> float:
        return flops_per_token(self.config) * self.tokens

    @property
    def active_params(self) -> int:
        return active_params(self.config)

    @property
    def total_params(self) -> int:
        return total_params(self.config)

    def summary(self) -> dict[str, Any]:
        m, moe = self.config.model, self.config.moe
        return {"name": self.name, "d_model": m.d_model, "n_layers": m.n_layers,
                "n_experts": moe.n_experts, "top_k": moe.top_k, "d_ff": m.d_ff,
                "steps": self.config.train.steps, "active_params": self.active_params,
                "total_params": self.total_params, "tokens": self.tokens,
                "compute": self.compute}


@dataclass(frozen=True)
class LadderSpec:
    name: str
    out: Path
    rungs: tuple[Rung, ...]
    target: Rung
    fit: FitOptions

    def runs(self) -> tuple[Rung, ...]:
        return (*self.rungs, self.target)


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """base with override's sections merged in, field by field (two levels deep)."""
    merged = {name: dict(fields) for name, fields in base.items()}
    for name, fields in override.items():
        if isinstance(fields, dict) and isinstance(merged.get(name), dict):
            merged[name].update(fields)
        else:
            merged[name] = fields
    return merged


def _rung(raw: Any, base: dict[str, Any], where: str, default_name: str) -> Rung:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of config sections, got {raw!r}")
    raw = dict(raw)
    name = raw.pop("name", default_name)
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"{where}.name: {name!r} must be a plain directory name "
                          "(letters, digits, '_', '-', '.')")
    try:
        config = config_from_dict(merge(base, raw))
    except ConfigError as err:
        raise ConfigError(f"{where} ({name}): {err}") from err
    return Rung(name, config)


def _fit_options(raw: Any) -> FitOptions:
    if raw is None:
        return FitOptions()
    if not isinstance(raw, dict):
        raise ConfigError(f"fit: expected a mapping, got {raw!r}")
    names = {f.name for f in dataclasses.fields(FitOptions)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"fit: unknown key(s) {unknown}; valid keys are {sorted(names)}")
    options = FitOptions(**raw)
    if not isinstance(options.bootstrap, int) or options.bootstrap < 10:
        raise ConfigError(f"fit.bootstrap: must be an integer >= 10, got {options.bootstrap!r}")
    if not 0 < options.confidence < 1:
        raise ConfigError(f"fit.confidence: must be in (0, 1), got {options.confidence!r}")
    return options


def validate_compute(rungs: tuple[Rung, ...], target: Rung) -> None:
    """Rungs strictly rising in compute; the target at least MIN_TARGET_RATIO x beyond them."""
    if len(rungs) < MIN_RUNGS:
        raise ConfigError(f"rungs: the law L(C) = E + A*C^-alpha has 3 parameters and needs at "
                          f"least {MIN_RUNGS} rungs (4 or more recommended), got {len(rungs)}")
    names = [r.name for r in (*rungs, target)]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"rungs: names {duplicates} are used twice; each run needs its own "
                          "directory, rename them")
    for i, (lower, upper) in enumerate(zip(rungs, rungs[1:], strict=False), start=1):
        if upper.compute <= lower.compute:
            raise ConfigError(
                f"rungs[{i}] ({upper.name}): compute {upper.compute:.3g} FLOPs is not above "
                f"rungs[{i - 1}] ({lower.name})'s {lower.compute:.3g}; order the rungs by "
                "strictly rising compute (C = flops_per_token * steps * batch_size * seq_len)")
    low, high = rungs[0].compute, rungs[-1].compute
    if target.compute <= high:
        inside = "inside" if target.compute >= low else "below"
        raise ConfigError(
            f"target ({target.name}): compute {target.compute:.3g} FLOPs lies {inside} the rung "
            f"range [{low:.3g}, {high:.3g}]; a ladder predicts a larger run, so give the target "
            f"at least {MIN_TARGET_RATIO:g}x the largest rung's compute")
    if target.compute < MIN_TARGET_RATIO * high:
        raise ConfigError(
            f"target ({target.name}): compute {target.compute:.3g} FLOPs is only "
            f"{target.compute / high:.2f}x the largest rung ({rungs[-1].name}, {high:.3g}); it "
            f"must be at least {MIN_TARGET_RATIO:g}x: raise the target's train.steps or size, "
            "or shrink the rungs")


def spec_from_dict(raw: Any, name: str, out: str | Path | None = None) -> LadderSpec:
    """Build and validate a spec; `out` overrides the spec's own out."""
    if not isinstance(raw, dict):
        raise ConfigError(f"ladder spec: expected a mapping at the top level, got {raw!r}")
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise ConfigError(f"ladder spec: unknown key(s) {unknown}; valid keys are "
                          f"{sorted(SPEC_KEYS)}")
    name = raw.get("name", name)
    base = raw.get("base") or {}
    if not isinstance(base, dict) or not all(isinstance(v, dict) for v in base.values()):
        raise ConfigError("base: expected a mapping of config sections (model, data, ...)")
    rungs_raw = raw.get("rungs")
    if not isinstance(rungs_raw, list):
        raise ConfigError("rungs: expected a list of rungs, each a mapping of config sections")
    if "target" not in raw:
        raise ConfigError("target: missing; the ladder needs one target run to predict")
    rungs = tuple(_rung(r, base, f"rungs[{i}]", f"rung{i + 1}") for i, r in enumerate(rungs_raw))
    target = _rung(raw["target"], base, "target", "target")
    validate_compute(rungs, target)
    return LadderSpec(name=name, out=Path(out or raw.get("out") or Path("runs/ladder") / name),
                      rungs=rungs, target=target, fit=_fit_options(raw.get("fit")))


def load_spec(path: str | Path, out: str | Path | None = None) -> LadderSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"ladder spec {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"ladder spec {path} is not valid YAML: {err}") from err
    return spec_from_dict(raw, path.stem, out)
