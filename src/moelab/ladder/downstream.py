"""Downstream next to the loss: does task accuracy (or the gold answer's bits per byte)
follow the validation loss across the ladder's rungs and its target?

`moelab ladder report SPEC --downstream` scores the last checkpoint of every point's
first replicate and of the target on the local held-out tasks (`moelab.eval`), writes
downstream.json / downstream.md beside the report, and states whether the downstream
metric orders the runs as the loss does (Spearman rank correlation across runs: loss vs
gold-answer bpb should be near +1, loss vs accuracy near -1). At small scale the gold
answer's bpb is the useful one: accuracy sits near chance until the model is capable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from moelab.config import data_dir
from moelab.ladder.results import is_finished, result, run_dir
from moelab.ladder.spec import LadderSpec

DOWNSTREAM_JSON, DOWNSTREAM_MD = "downstream.json", "downstream.md"


def _spearman(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _score(path: Path, items: int, seed: int) -> dict[str, dict]:
    """Task scores of a run's latest checkpoint (cached in RUN/eval for these settings)."""
    from moelab.data.tokenizer import load_tokenizer
    from moelab.eval.harness import score_tasks
    from moelab.eval.tasks import task_names
    from moelab.train.checkpoint import load_latest

    model, cfg, step = load_latest(path)
    cached = path / "eval" / f"tasks-step{step}.json"
    if cached.is_file():
        record = json.loads(cached.read_text())
        if record.get("items") == items and record.get("seed") == seed:
            return record["scores"]
    data = data_dir(cfg.data.path)
    scores = score_tasks(model, cfg, load_tokenizer(data), task_names(data),
                         path / "eval" / "tasks", items, seed)
    cached.write_text(json.dumps({"run_dir": str(path), "step": step, "kind": "tasks",
                                  "seed": seed, "items": items, "scores": scores}, indent=1))
    return scores


def downstream(spec: LadderSpec, items: int = 100, seed: int = 0) -> dict[str, Any]:
    """Per run: its final metric (the spec's fit.metric), mean task acc / acc_norm / gold
    bpb over the local tasks; and the rank correlations across runs."""
    runs = [reps[0] for reps in spec.points().values()] + [spec.target]
    rows = []
    for rung in runs:
        path = run_dir(spec, rung)
        if not is_finished(rung, path):
            continue
        scores = _score(path, items, seed)
        means = {key: float(np.mean([s[key] for s in scores.values()]))
                 for key in ("acc", "acc_stderr", "acc_norm", "gold_bpb")}
        rows.append({"run": rung.name, "target": rung is spec.target,
                     "loss": result(rung, path, spec.fit.metric).final_val_loss,
                     **means, "tasks": scores})
    loss = [r["loss"] for r in rows]
    corr = {key: _spearman(loss, [r[key] for r in rows]) for key in ("gold_bpb", "acc")}
    follows = {"gold_bpb": corr["gold_bpb"] is not None and corr["gold_bpb"] >= 0.8,
               "acc": corr["acc"] is not None and corr["acc"] <= -0.8}
    return {"metric": spec.fit.metric, "items": items, "seed": seed, "runs": rows,
            "spearman_with_loss": corr, "follows_loss": follows}


def write_downstream(spec: LadderSpec, items: int = 100, seed: int = 0) -> dict[str, Any]:
    """downstream() written to OUT/downstream.json and .md; returns it."""
    report = downstream(spec, items, seed)
    (spec.out / DOWNSTREAM_JSON).write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Ladder {spec.name}: downstream next to the loss", "",
             f"Local held-out tasks (cont_<domain>, {items} items each, seed {seed}, 4-way, "
             "chance 0.25), mean over tasks; loss = the ladder's metric "
             f"({report['metric']}).", "",
             "| run | loss | acc | acc_norm | gold-answer bpb |", "| --- | --- | --- | --- | --- |"]
    for r in report["runs"]:
        name = f"**{r['run']}** (target)" if r["target"] else r["run"]
        lines.append(f"| {name} | {r['loss']:.4f} | {r['acc']:.3f} +- {r['acc_stderr']:.3f} | "
                     f"{r['acc_norm']:.3f} | {r['gold_bpb']:.4f} |")
    c, f = report["spearman_with_loss"], report["follows_loss"]
    fmt = lambda v: "n/a (fewer than 3 runs)" if v is None else f"{v:+.2f}"  # noqa: E731
    verb = lambda ok: "follows" if ok else "does not follow"  # noqa: E731
    lines += ["", "Rank correlation with the loss across runs: gold-answer bpb "
              f"{fmt(c['gold_bpb'])} ({verb(f['gold_bpb'])} the loss), accuracy "
              f"{fmt(c['acc'])} ({verb(f['acc'])} it).", ""]
    (spec.out / DOWNSTREAM_MD).write_text("\n".join(lines))
    print("\n".join(lines))
    return report
