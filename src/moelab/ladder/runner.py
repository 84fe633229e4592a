"""`run_ladder(spec)`: train the rungs, fit, pre-register, train the target, report.

Each run lives in <out>/<name>/ and is trained by the ordinary trainer, which resumes a
half-finished run from its last checkpoint, and scores it on the whole val split every
1/evals of its steps (moelab.ladder.evaluate). A cooldown branch starts from its parent's
checkpoint at the branch step (the trainer's `--from` branching, lineage recorded) with the
branch's own (shorter) schedule. A finished run (its last metrics record is the final step,
scored) is not even reopened, so re-running a ladder costs nothing for the runs already
done, and never touches their files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from moelab.config import config_to_dict
from moelab.errors import UserError
from moelab.jobs import Job, run_jobs
from moelab.ladder import preflight, prereg, repetition
from moelab.ladder.fit import FitError
from moelab.ladder.predict import forecast
from moelab.ladder.report import refusal_markdown, write_report
from moelab.ladder.results import (
    LOGGED,
    RunResult,
    add_time,
    check_run_dir,
    is_finished,
    metrics,
    result,
    run_dir,
)
from moelab.ladder.spec import LadderSpec, Rung


def ensure_trained(spec: LadderSpec, rung: Rung, label: str,
                   experiment: str | None = None) -> RunResult:
    """Train (or resume, or just read) one run and return its result."""
    path = run_dir(spec, rung)
    check_run_dir(rung, path)
    head = (f"[ladder {spec.name}] {label} {rung.name}: N_active={rung.active_params:,} "
            f"D={rung.tokens:,} C={rung.compute:.3g}")
    if is_finished(rung, path):
        done = result(rung, path, spec.fit.metric)
        print(f"{head}: already trained, {spec.fit.metric}={done.final_val_loss:.4f}", flush=True)
        return done
    import moelab.lab  # noqa: F401  (registers the lab the trainer reports to: train/sink.py)
    from moelab.ladder.evaluate import make_evaluator
    from moelab.train import trainer  # jax is imported only when something trains

    parent = None
    if rung.parent:
        source = spec.out / rung.parent / "checkpoints" / str(rung.branch_step)
        if not metrics(path) and not source.is_dir():
            raise UserError(f"{rung.name} branches from {source}, which does not exist; "
                            f"delete {spec.out / rung.parent} to retrain its parent with "
                            "that checkpoint")
        parent = trainer.Parent(spec.out / rung.parent, rung.branch_step)
    resuming = " (resuming)" if metrics(path) or rung.parent else ""
    print(f"{head}: training {rung.config.train.steps} steps{resuming}", flush=True)
    started, cpu = time.time(), time.process_time()
    trainer.prepared_data(rung.config)
    # A branch starts from its parent's checkpoint as `moelab train --from` does, under
    # its own schedule and plan: a config change at the branch step, accepted and recorded
    # (check_run_dir above has already refused a run dir holding another config). Its plan
    # may end a stage earlier than the parent's (a staged ladder's stage at 80% of a
    # shorter run): the steps before the branch are the parent's, as for the LR.
    trainer.train(rung.config, path, experiment, allow_config_change=bool(rung.parent),
                  evaluator=make_evaluator(rung.config), parent=parent)
    elapsed = time.time() - started
    add_time(spec.out, rung.name, elapsed, time.process_time() - cpu)
    done = result(rung, path, spec.fit.metric)
    print(f"{head}: done in {elapsed:.0f}s, {spec.fit.metric}={done.final_val_loss:.4f}",
          flush=True)
    return done


# ------------------------------------------------------------------- prediction


def preregister(spec: LadderSpec, results: list[RunResult], lr_results: list[RunResult],
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
        by_name = {r.name: r for r in [*results, *lr_results]}
        passes = repetition.check(spec)  # refuses a target past the rungs' repetition
        try:
            content = forecast(spec, results, lr_results)
        except FitError as err:  # a refusal is a result too: kept beside the rungs
            write_refusal(spec, results, str(err), hashes, passes, err.detail)
            raise
        record = {
            "kind": prereg.KIND, "ladder": spec.name, "created_at": prereg.utc_now(),
            **content,
            "rungs": [{**rung.summary(), **by_name[rung.name].to_dict(),
                       "config": config_to_dict(rung.config),
                       "config_sha256": hashes[rung.name]}
                      for rung in (*spec.rungs, *spec.lr_runs)],
            "target": {**spec.target.summary(), "config": config_to_dict(spec.target.config),
                       "config_sha256": hashes[spec.target.name]},
            "code_version": prereg.code_version(),
            "corpus": repetition.corpus(spec), "passes": passes,
        }
        if prereg.write_once(path, record):
            p = record["prediction"]
            print(f"[ladder {spec.name}] pre-registered {path}: target val_loss "
                  f"{p['value']:.4f} [{p['low']:.4f}, {p['high']:.4f}] "
                  f"({p['confidence']:.0%}, law {p['law']})", flush=True)
            if p.get("laws_disagree", {}).get("exceeds"):
                print(f"[ladder {spec.name}] {p['laws_disagree']['note']}", flush=True)
            fit = ((record.get("laws") or {}).get(p["law"]) or {}).get("fit")
            if isinstance(fit, dict) and fit.get("unidentified"):
                print(f"[ladder {spec.name}] note: law {p['law']} is not identified by the "
                      f"rungs (its Jacobian's condition number {fit['condition']:.2g}): its "
                      "value at the target is set by where the fit stops", flush=True)
    record = read_preregistration(spec)
    if experiment:
        _register_in_lab(spec, record, experiment)
    return record


def config_hashes(spec: LadderSpec) -> dict[str, str]:
    return {r.name: prereg.config_sha256(r.config) for r in spec.runs()}


def write_refusal(spec: LadderSpec, results: list[RunResult], reason: str,
                  hashes: dict[str, str], passes: dict[str, Any],
                  detail: dict[str, Any] | None = None) -> None:
    """<out>/refusal.json: the pre-registration's one-line reason for refusing the target,
    with what the refusing check computed (`detail`: the law's fit and its interval at the
    target), the rung losses, fit options, code and corpus it was decided on (replaced by
    the latest refusal; a pre-registration written later, with other fit options, leaves
    it as the record of what was refused first)."""
    record = {"kind": prereg.REFUSAL_KIND, "ladder": spec.name,
              "created_at": prereg.utc_now(), "reason": reason, "detail": detail,
              "fit_options": dataclasses.asdict(spec.fit),
              "rungs": [{**rung.summary(), **res.to_dict(), "config_sha256": hashes[rung.name]}
                        for rung, res in zip(spec.rungs, results, strict=True)],
              "target": {**spec.target.summary(), "config_sha256": hashes[spec.target.name]},
              "code_version": prereg.code_version(), "corpus": repetition.corpus(spec),
              "passes": passes}
    record = json.loads(json.dumps(record, default=str))  # as the file holds it
    path = spec.out / prereg.REFUSAL_FILE
    try:  # the same refusal again (a rerun): it was decided when first written
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        earlier = {}
    if earlier.get("reason") == reason and earlier.get("rungs") == record["rungs"]:
        record["created_at"] = earlier["created_at"]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    (spec.out / prereg.REFUSAL_MD).write_text(refusal_markdown(record))
    print(f"[ladder {spec.name}] refused at pre-registration; the reason and the rungs it "
          f"was decided on are in {path}", flush=True)


def read_preregistration(spec: LadderSpec) -> dict[str, Any]:
    """The ladder's pre-registration, checked against its sha256 and the spec's configs."""
    path = spec.out / prereg.PREREG_FILE
    if not path.exists():
        refusal = spec.out / prereg.REFUSAL_FILE
        if refusal.is_file():
            try:
                reason = json.loads(refusal.read_text()).get("reason", "")
            except (OSError, ValueError, AttributeError) as err:  # damaged by hand
                raise UserError(f"no pre-registration at {path}, and its refusal "
                                f"{refusal} cannot be read ({type(err).__name__}): "
                                "rerun `moelab ladder run` to decide again") from None
            raise UserError(f"no pre-registration at {path}: the target was refused "
                            f"({refusal}): {reason}")
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
        # scored on the target's run, on the metric its evaluator logs (LOGGED), so the lab
        # scores it once the target has trained; p["metric"] describes that number
        store.add_prediction(experiment, name, p["value"], p["low"], p["high"],
                             {"preregistration": str(spec.out / prereg.PREREG_FILE),
                              "sha256": record["sha256"], "metric": LOGGED[spec.fit.metric],
                              "description": p["metric"],
                              "law": p["law"], "fit": record["laws"][p["law"]]["fit"],
                              "target": record["target"]["name"],
                              "run": str(run_dir(spec, spec.target))})


def run_ladder(spec: LadderSpec, experiment: str | None = None, ray: str | None = None,
               cpus: float = 1.0, **ray_options: Any) -> dict[str, Any]:
    """The whole ladder; returns the report (also written to <out>/report.json).

    The runs are jobs (`moelab.jobs`): in this process in order, or with `ray` as Ray tasks
    on a cluster, a branch waiting for its parent and the target for the pre-registration,
    which waits for every rung. Either way each run trains with the same config and seed,
    so the numbers are the same."""

    from moelab.train import trainer

    trainer.prepared_data(spec.target.config)  # the corpus whose passes are counted
    if not (spec.out / prereg.PREREG_FILE).exists():  # else it was decided when registered
        repetition.check(spec)  # a target past the rungs' repetition: refused before they train
        preflight.check_spec(spec)  # a law that cannot be fitted: refused before rungs train
    spec.out.mkdir(parents=True, exist_ok=True)
    before = spec.rungs + spec.lr_runs
    done = train_runs([(spec, before)], experiment, ray, cpus, **ray_options)
    results = [done[r.name] for r in spec.rungs]
    lr_results = [done[r.name] for r in spec.lr_runs]
    record = preregister(spec, results, lr_results, experiment)
    actual = train_runs([(spec, (spec.target,))], experiment, ray, cpus,
                        **ray_options)[spec.target.name]
    return write_report(spec, record, actual)


def train_runs(runs: list[tuple[LadderSpec, tuple[Rung, ...]]], experiment: str | None = None,
               ray: str | None = None, cpus: float = 1.0, **ray_options: Any
               ) -> dict[str, RunResult]:
    """Train (or read) the given runs of one or more ladders as jobs; {name: result}, names
    prefixed with "<ladder>/" when there are several ladders."""
    if ray is not None:  # the default corpus is prepared here once, not by parallel tasks
        from moelab.config import DataConfig
        from moelab.train import trainer

        configs = {r.config.data.path: r.config for _, rungs in runs for r in rungs}
        if DataConfig().path in configs:
            trainer.prepared_data(configs[DataConfig().path])
    prefix = len(runs) > 1
    jobs = []
    for spec, rungs in runs:
        spec.out.mkdir(parents=True, exist_ok=True)
        label = "target" if rungs == (spec.target,) else None
        jobs += [ladder_job(spec, rung, label or f"run {i}/{len(rungs)}", experiment, ray, cpus,
                            f"{spec.name}/" if prefix else "")
                 for i, rung in enumerate(rungs, start=1)]
    return run_jobs(jobs, ray, **ray_options)


def ladder_job(spec: LadderSpec, rung: Rung, label: str, experiment: str | None,
               ray: str | None = None, cpus: float = 1.0, prefix: str = "") -> Job:
    """One run of the ladder as a job: a branch waits for its parent's run."""
    from moelab.train.memory import estimate_bytes

    memory = sum(estimate_bytes(rung.config)) if ray is not None else 0
    return Job(prefix + rung.name, train_rung, (spec, rung, label, experiment),
               after=(prefix + rung.parent,) if rung.parent else (),
               run_dir=run_dir(spec, rung).resolve(), cpus=cpus, memory_bytes=memory)


def train_rung(spec: LadderSpec, rung: Rung, label: str, experiment: str | None,
               *parents: RunResult) -> RunResult:
    """A job's body: `ensure_trained` (the parent's result only orders it after the parent)."""
    return ensure_trained(spec, rung, label, experiment)


def finished_rungs(spec: LadderSpec) -> tuple[list[RunResult], list[RunResult]]:
    """Results of all rungs and lr probes, or a UserError naming those not trained yet."""
    runs = spec.rungs + spec.lr_runs
    missing = [r.name for r in runs if not is_finished(r, run_dir(spec, r))]
    if missing:
        raise UserError(f"runs not trained yet: {', '.join(missing)}; run `moelab ladder run`")
    for rung in runs:
        check_run_dir(rung, run_dir(spec, rung))
    return ([result(r, run_dir(spec, r), spec.fit.metric) for r in spec.rungs],
            [result(r, run_dir(spec, r), spec.fit.metric) for r in spec.lr_runs])


def report_ladder(spec: LadderSpec) -> dict[str, Any]:
    """Rebuild the report of a ladder whose target has finished, without training."""

    record = read_preregistration(spec)
    target_dir = run_dir(spec, spec.target)
    if not is_finished(spec.target, target_dir):
        raise UserError(f"the target has not finished training in {target_dir}; "
                        "run `moelab ladder run` to train it")
    return write_report(spec, record, result(spec.target, target_dir, spec.fit.metric))
