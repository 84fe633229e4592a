"""A ladder run's results on disk: what each finished run contributes to the fits (its
whole-val-split curve, final loss, stability numbers) and what it cost. Read by the runner,
the predictions and the report alike, so none of them imports another's orchestration.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moelab.config import ConfigError, config_from_dict, config_to_dict, data_dir
from moelab.data.loader import read_meta
from moelab.data.loader import source_weights as mixture_source_weights
from moelab.errors import UserError
from moelab.ladder.spec import LadderSpec, Rung, stable_end
from moelab.schema import MapOf, Number, read_json, read_yaml
from moelab.train.metrics import METRIC_SPEC, JsonlLog
from moelab.train.rundir import CONFIG_FILE, METRICS_FILE

# (for a mixture of cells, the weights are each source's share of the tokens it draws:
# loader.source_weights)
FINAL_LOSS = ("cross-entropy (nats/token) of the final model over every window of the "
              "validation split, averaged over data sources with the training mixture's weights")
FINAL_BPB = ("bits per byte of the final model over every window of the validation split "
             "(tokenizer-independent), macro-averaged over data sources (each weighs the same)")
# fit.metric -> what the ladder fits and predicts; "loss" is the default
METRICS = {"loss": FINAL_LOSS, "bpb_macro": FINAL_BPB}
LOSS_MIXTURE = "val_loss_mixture"  # the "loss" score as the ladder's evaluator logs it
TIMINGS_FILE = "timings.json"
TIMINGS_SPEC = MapOf({"wall_s": Number, "cpu_s": Number})
VAL_PREFIX = "val_loss/"
BPB_PREFIX, BPB_MACRO = "val_bpb/", "val_bpb_macro"
LOGGED = {"loss": LOSS_MIXTURE, "bpb_macro": BPB_MACRO}  # fit.metric -> its logged name


@dataclass(frozen=True)
class RunResult:
    """What a finished run contributes to the fits."""

    name: str
    point: str
    seed: int
    active_params: int
    total_params: int
    tokens: int
    compute: float
    final_val_loss: float  # the spec's fit.metric: CE (default) or bpb_macro
    val_loss: dict[str, float]  # the metric per source, over the whole val split, at the end
    curve: list[dict[str, float]] = field(default_factory=list)  # {step, loss} per eval
    stability: dict[str, float] = field(default_factory=dict)  # grad norm, logit z

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_dir(spec: LadderSpec, rung: Rung) -> Path:
    return spec.out / rung.name


def metrics(path: Path) -> list[dict]:
    return JsonlLog(path / METRICS_FILE, METRIC_SPEC).read()


def is_finished(rung: Rung, path: Path) -> bool:
    records = metrics(path)
    return bool(records) and records[-1].get("step") == rung.config.train.steps and any(
        k.startswith(VAL_PREFIX) for k in records[-1])


def check_run_dir(rung: Rung, path: Path) -> None:
    """Refuse to resume or reuse a run directory that holds another config's run."""
    saved = path / CONFIG_FILE
    if not saved.exists():
        return
    raw = read_yaml(saved, "run's config")
    raw = raw if isinstance(raw, dict) else {}
    try:
        same = config_from_dict(raw) == rung.config
    except ConfigError:
        same = False
    if not same:
        now = config_to_dict(rung.config)
        changed = sorted(
            f"{section}.{k}" if isinstance(fields, dict) else section
            for section, fields in now.items()
            for k, v in (fields.items() if isinstance(fields, dict) else [("", fields)])
            if (_section(raw, section).get(k) if isinstance(fields, dict)
                else raw.get(section)) != v)
        raise UserError(f"{path} holds a run of a different config than {rung.name}'s (changed: "
                        f"{', '.join(changed) or 'unreadable config.yaml'}); delete that "
                        "directory to retrain it, or run the ladder with another --out")


def _section(raw: dict, name: str) -> dict:
    """A section of a run's saved config, {} where it is missing or not a mapping."""
    section = raw.get(name)
    return section if isinstance(section, dict) else {}


def source_weights(config) -> dict[str, float]:
    """{source: weight} of the run's data.mixture (by size when empty): the weights of the
    ladder's "loss" score. A staged run keeps its data.mixture's weights in every stage, so
    its curve is one yardstick across the switch."""
    meta = read_meta(data_dir(config.data.path))
    return mixture_source_weights(meta, config.data.mixture)


def weighted_loss(record: dict, weights: dict[str, float]) -> float:
    """The sources' val_loss/<source> in `record`, averaged with `weights`."""
    scored = {s: w for s, w in weights.items() if w > 0 and VAL_PREFIX + s in record}
    return float(sum(w * record[VAL_PREFIX + s] for s, w in scored.items())
                 / sum(scored.values()))


def _stability(rung: Rung, records: list[dict]) -> dict[str, float]:
    """Grad norm and output log-normalizer over the last 10% of the stable phase (before
    the decay shrinks the updates), and the grad norm's largest 20-step median after warmup."""
    end, start = stable_end(rung.config), rung.config.optim.warmup_steps
    window = max((end - start) // 10, 1)
    late = [r for r in records if end - window < r["step"] <= end and "grad_norm" in r]
    after = [r["grad_norm"] for r in records if r["step"] > start and "grad_norm" in r]
    if not late or not after:
        return {}
    peaks = [float(np.median(after[i : i + 20])) for i in range(0, max(len(after) - 19, 1))]
    return {"grad_norm": float(np.median([r["grad_norm"] for r in late])),
            "grad_norm_peak": max(peaks),
            "logit_z": float(np.median([r["logit_z"] for r in late]))}


def result(rung: Rung, path: Path, metric: str = "loss") -> RunResult:
    """The finished run's scores on the whole val split: with metric "loss" the CE,
    mixture-weighted over sources; with "bpb_macro" the bits per byte, macro-averaged."""
    records = metrics(path)
    weights = source_weights(rung.config)
    scored = [r for r in records if any(k.startswith(VAL_PREFIX) for k in r)]
    if metric == "bpb_macro":
        if not all(BPB_MACRO in r for r in scored):
            raise UserError(f"{path}: fit.metric bpb_macro, but this run logged no "
                            f"{BPB_MACRO} (trained before bpb existed, or its dataset has no "
                            "tokenizer.json); retrain it or use fit.metric: loss")
        score, prefix = (lambda r: float(r[BPB_MACRO])), BPB_PREFIX
    else:
        score, prefix = (lambda r: weighted_loss(r, weights)), VAL_PREFIX
    last = scored[-1]
    curve = [{"step": r["step"], "loss": score(r)} for r in scored]
    return RunResult(rung.name, rung.point or rung.name, rung.seed, rung.active_params,
                     rung.total_params, rung.tokens, rung.compute, curve[-1]["loss"],
                     {k.removeprefix(prefix): float(v) for k, v in last.items()
                      if k.startswith(prefix)},
                     curve, _stability(rung, records))


def add_time(out: Path, name: str, wall_s: float, cpu_s: float) -> None:
    """Add a run's cost to timings.json; runs of one ladder may finish at once on several
    nodes, so the read-modify-write holds a lock and replaces the file atomically."""
    path = out / TIMINGS_FILE
    with open(out / (TIMINGS_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        spent = read_json(path, TIMINGS_SPEC) if path.exists() else {}
        before = spent.get(name, {"wall_s": 0.0, "cpu_s": 0.0})
        spent[name] = {"wall_s": before["wall_s"] + wall_s, "cpu_s": before["cpu_s"] + cpu_s}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(spent, indent=1) + "\n")
        os.replace(tmp, path)


def timings(out: Path) -> dict[str, dict[str, float]]:
    """Per run: wall and process CPU seconds spent training and scoring it, summed over
    `ladder run` invocations. CPU seconds count all cores, and unlike wall time do not grow
    when other work shares the machine."""
    path = out / TIMINGS_FILE
    return read_json(path, TIMINGS_SPEC) if path.exists() else {}
