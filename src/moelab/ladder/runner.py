"""`run_ladder(spec)`: train the rungs, fit, pre-register, train the target, report.

Each run lives in <out>/<name>/ and is trained by the ordinary trainer, which resumes a
half-finished run from its last checkpoint. A finished run (its last metrics record is
the final step) is not even reopened, so re-running a ladder costs nothing for the runs
already done, and never touches their files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from moelab.config import ConfigError, config_from_dict, config_to_dict
from moelab.data.loader import mixture_weights, read_meta
from moelab.errors import UserError
from moelab.ladder import prereg
from moelab.ladder.fit import (
    FitError,
    bootstrap_interval,
    fit_chinchilla,
    fit_power_law,
)
from moelab.ladder.spec import LadderSpec, Rung
from moelab.train.metrics import JsonlLog
from moelab.train.rundir import CONFIG_FILE, METRICS_FILE

FINAL_LOSS = ("validation cross-entropy (nats/token) at the run's last step, averaged over "
              "data sources with the weights of the training mixture")
TIMINGS_FILE = "timings.json"


@dataclass(frozen=True)
class RunResult:
    """What a finished run contributes to the fit."""

    name: str
    active_params: int
    total_params: int
    tokens: int
    compute: float
    final_val_loss: float
    val_loss: dict[str, float]  # per source, at the last step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_dir(spec: LadderSpec, rung: Rung) -> Path:
    return spec.out / rung.name


def metrics(path: Path) -> list[dict]:
    return JsonlLog(path / METRICS_FILE).read()


def is_finished(rung: Rung, path: Path) -> bool:
    records = metrics(path)
    return bool(records) and records[-1].get("step") == rung.config.train.steps and any(
        k.startswith("val_loss/") for k in records[-1])


def check_run_dir(rung: Rung, path: Path) -> None:
    """Refuse to resume or reuse a run directory that holds another config's run."""
    saved = path / CONFIG_FILE
    if not saved.exists():
        return
    raw = yaml.safe_load(saved.read_text())
    try:
        same = config_from_dict(raw) == rung.config
    except ConfigError:
        same = False
    if not same:
        now = config_to_dict(rung.config)
        changed = sorted(f"{section}.{k}" for section, fields in now.items()
                         for k, v in fields.items() if (raw.get(section) or {}).get(k) != v)
        raise UserError(f"{path} holds a run of a different config than {rung.name}'s (changed: "
                        f"{', '.join(changed) or 'unreadable config.yaml'}); delete that "
                        "directory to retrain it, or run the ladder with another --out")


def result(rung: Rung, path: Path) -> RunResult:
    """The finished run's final validation loss, mixture-weighted over sources."""
    last = metrics(path)[-1]
    by_source = {k.split("/", 1)[1]: float(v) for k, v in last.items()
                 if k.startswith("val_loss/")}
    meta = read_meta(rung.config.data.path)
    weights = dict(zip(meta["sources"], mixture_weights(meta, "train", rung.config.data.mixture),
                       strict=True))
    scored = {s: w for s, w in weights.items() if w > 0 and s in by_source}
    loss = sum(w * by_source[s] for s, w in scored.items()) / sum(scored.values())
    return RunResult(rung.name, rung.active_params, rung.total_params, rung.tokens,
                     rung.compute, float(loss), by_source)


def _add_time(out: Path, name: str, wall_s: float, cpu_s: float) -> None:
    path = out / TIMINGS_FILE
    spent = json.loads(path.read_text()) if path.exists() else {}
    before = spent.get(name, {"wall_s": 0.0, "cpu_s": 0.0})
    spent[name] = {"wall_s": before["wall_s"] + wall_s, "cpu_s": before["cpu_s"] + cpu_s}
    path.write_text(json.dumps(spent, indent=1) + "\n")


def timings(out: Path) -> dict[str, dict[str, float]]:
    """Per run: wall and process CPU seconds spent training it, summed over `ladder run`
    invocations. CPU seconds count all cores, and unlike wall time do not grow when other
    work shares the machine."""
    path = out / TIMINGS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def ensure_trained(spec: LadderSpec, rung: Rung, label: str,
                   experiment: str | None = None) -> RunResult:
    """Train (or resume, or just read) one run and return its result."""
    path = run_dir(spec, rung)
    check_run_dir(rung, path)
    head = (f"[ladder {spec.name}] {label} {rung.name}: N_active={rung.active_params:,} "
            f"D={rung.tokens:,} C={rung.compute:.3g}")
    if is_finished(rung, path):
        done = result(rung, path)
        print(f"{head}: already trained, val_loss={done.final_val_loss:.4f}", flush=True)
        return done
    from moelab.train.trainer import train  # jax is imported only when something trains

    resuming = " (resuming)" if metrics(path) else ""
    print(f"{head}: training {rung.config.train.steps} steps{resuming}", flush=True)
    started, cpu = time.time(), time.process_time()
    train(rung.config, path, experiment)
    elapsed = time.time() - started
    _add_time(spec.out, rung.name, elapsed, time.process_time() - cpu)
    done = result(rung, path)
    print(f"{head}: done in {elapsed:.0f}s, val_loss={done.final_val_loss:.4f}", flush=True)
    return done


# ------------------------------------------------------------------- prediction


def predict(spec: LadderSpec, results: list[RunResult]) -> dict[str, Any]:
    """Fit both laws to the rungs and predict the target (raises FitError for L(C))."""
    compute = [r.compute for r in results]
    loss = [r.final_val_loss for r in results]
    fit = fit_power_law(compute, loss)
    target = spec.target
    interval = bootstrap_interval(fit, compute, loss, target.compute, spec.fit.bootstrap,
                                  spec.fit.confidence, spec.fit.seed)
    prediction = {"value": float(fit.predict(target.compute)), **interval.to_dict(),
                  "metric": FINAL_LOSS, "compute": target.compute}
    try:
        nd = fit_chinchilla([r.active_params for r in results], [r.tokens for r in results], loss)
        secondary = {"fit": nd.to_dict(),
                     "value": float(nd.predict(target.active_params, target.tokens))}
    except FitError as err:  # secondary: reported, never fatal
        secondary = {"skipped": str(err)}
    return {"prediction": prediction, "fit": fit.to_dict(), "fit_options": asdict(spec.fit),
            "secondary": secondary}


def preregister(spec: LadderSpec, results: list[RunResult],
                experiment: str | None = None) -> dict[str, Any]:
    """The pre-registration record: written now if absent, else read back and checked."""
    path = spec.out / prereg.PREREG_FILE
    hashes = config_hashes(spec)
    if not path.exists():
        target_dir = run_dir(spec, spec.target)
        if metrics(target_dir):
            raise UserError(f"{target_dir} already has training metrics but there is no "
                            f"{path}; a prediction made now would not be a pre-registration. "
                            "Delete the target's directory to train it afresh")
        record = {
            "kind": prereg.KIND, "ladder": spec.name, "created_at": prereg.utc_now(),
            **predict(spec, results),
            "rungs": [{**rung.summary(), **r.to_dict(), "config": config_to_dict(rung.config),
                       "config_sha256": hashes[rung.name]}
                      for r, rung in zip(results, spec.rungs, strict=True)],
            "target": {**spec.target.summary(), "config": config_to_dict(spec.target.config),
                       "config_sha256": hashes[spec.target.name]},
            "code_version": prereg.code_version(),
        }
        if prereg.write_once(path, record):
            p = record["prediction"]
            print(f"[ladder {spec.name}] pre-registered {path}: target val_loss "
                  f"{p['value']:.4f} [{p['low']:.4f}, {p['high']:.4f}] "
                  f"({p['confidence']:.0%})", flush=True)
    record = read_preregistration(spec)
    if experiment:
        _register_in_lab(spec, record, experiment)
    return record


def config_hashes(spec: LadderSpec) -> dict[str, str]:
    return {r.name: prereg.config_sha256(r.config) for r in spec.runs()}


def read_preregistration(spec: LadderSpec) -> dict[str, Any]:
    """The ladder's pre-registration, checked against its sha256 and the spec's configs."""
    path = spec.out / prereg.PREREG_FILE
    if not path.exists():
        raise UserError(f"no pre-registration at {path}; run `moelab ladder run` first")
    record = prereg.read(path)
    prereg.check_matches(record, path, config_hashes(spec))
    return record


def _register_in_lab(spec: LadderSpec, record: dict[str, Any], experiment: str) -> None:
    """Add the prediction to the lab experiment once, and only before the target trains."""
    from moelab.lab.store import Store, default_lab_path

    name = f"ladder/{spec.name}/target_val_loss"
    with Store(default_lab_path()) as store:
        if any(p.name == name for p in store.predictions(experiment)):
            return
        if metrics(run_dir(spec, spec.target)):
            print(f"[ladder {spec.name}] not adding {name} to {experiment}: the target has "
                  "started, so it would not be a pre-registration", flush=True)
            return
        p = record["prediction"]
        store.add_prediction(experiment, name, p["value"], p["low"], p["high"],
                             {"preregistration": str(spec.out / prereg.PREREG_FILE),
                              "sha256": record["sha256"], "metric": p["metric"],
                              "fit": record["fit"], "target": record["target"]["name"]})


def run_ladder(spec: LadderSpec, experiment: str | None = None) -> dict[str, Any]:
    """The whole ladder; returns the report (also written to <out>/report.json)."""
    from moelab.ladder.report import write_report

    spec.out.mkdir(parents=True, exist_ok=True)
    total = len(spec.rungs)
    results = [ensure_trained(spec, rung, f"rung {i}/{total}", experiment)
               for i, rung in enumerate(spec.rungs, start=1)]
    record = preregister(spec, results, experiment)
    actual = ensure_trained(spec, spec.target, "target", experiment)
    return write_report(spec, record, actual)


def finished_rungs(spec: LadderSpec) -> list[RunResult]:
    """Results of all rungs, or a UserError naming those not trained yet."""
    missing = [r.name for r in spec.rungs if not is_finished(r, run_dir(spec, r))]
    if missing:
        raise UserError(f"rungs not trained yet: {', '.join(missing)}; run `moelab ladder run`")
    for rung in spec.rungs:
        check_run_dir(rung, run_dir(spec, rung))
    return [result(r, run_dir(spec, r)) for r in spec.rungs]


def report_ladder(spec: LadderSpec) -> dict[str, Any]:
    """Rebuild the report of a ladder whose target has finished, without training."""
    from moelab.ladder.report import write_report

    record = read_preregistration(spec)
    target_dir = run_dir(spec, spec.target)
    if not is_finished(spec.target, target_dir):
        raise UserError(f"the target has not finished training in {target_dir}; "
                        "run `moelab ladder run` to train it")
    return write_report(spec, record, result(spec.target, target_dir))
