"""The same small ladder trained in one process and on a local Ray cluster of 1, 2 and 3
worker nodes (1 CPU each), side by side in one run: wall time and overhead per task.

    python3 bench/ladder_ray.py [--force]

Each Ray run is a task in a fresh worker process, so it pays what the sequential ladder
pays once: Python and JAX imports and the compile of its train and eval steps. The overhead
per task is (wall on 1 node - wall in one process) / number of runs. The machine has 2
cores: 3 nodes of 1 CPU oversubscribe it, so past 2 nodes the figure shows contention,
not the scaling a cluster of real machines would give; the numbers say what a node adds
here and what a task costs, which is what carries over. Needs the default corpus
(prepared here if missing). Results: bench/results/benchmarks/ladder_ray.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from machine import describe, load_per_core, refuse_if_busy, run_main, settle  # bench/machine.py

from moelab.config import DataConfig, data_dir
from moelab.jobs.local_cluster import DRIVER_ENV, LocalCluster
from moelab.ladder.runner import run_ladder
from moelab.ladder.spec import spec_from_dict

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "ladder_ray.json"
DATA = data_dir(DataConfig().path)  # the default corpus, where `moelab train` prepares it


def spec(out: Path):
    """Six independent rungs (one width, 50 / 100 / 200 steps of 8 x 64 tokens, 2 seeds)
    and a target 8x the largest: enough parallel work for 3 nodes, small enough for
    minutes. (Widths 16-64 at 200 steps flattened out on this corpus, so the rungs differ
    in tokens, which the compute law fits just as well.)"""
    base = {"model": {"vocab_size": 4096, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
            "moe": {"n_experts": 8, "top_k": 2, "dispatch": "dropless"},
            "data": {"path": str(DATA), "seq_len": 64, "batch_size": 8},
            "optim": {"lr": 3e-3, "warmup_steps": 20},
            "train": {"log_every": 1000, "eval_batches": 1, "checkpoint_every": 50}}
    rung = lambda name, d, steps: {"name": name, "model": {"d_model": d, "d_ff": d},
                                   "train": {"steps": steps}}
    raw = {"base": base, "seeds": [0, 1], "evals": 2,
           "rungs": [rung("s50", 32, 50), rung("s100", 32, 100), rung("s200", 32, 200)],
           "target": rung("target", 32, 1600), "fit": {"bootstrap": 20, "law": "compute"}}
    return spec_from_dict(raw, "bench", out)


def timed(label: str, **kwargs) -> dict:
    out = Path(tempfile.mkdtemp(prefix="ladder-ray-"))
    try:
        s = spec(out / "ladder")
        started = time.perf_counter()
        report = run_ladder(s, **kwargs)
        wall = time.perf_counter() - started
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"{label}: {wall:.1f} s, predicted {report['predicted']:.4f}, actual "
          f"{report['actual']:.4f}", flush=True)
    return {"wall_s": round(wall, 2), "predicted": report["predicted"],
            "actual": report["actual"], "runs": len(s.runs())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="write results on a busy machine")
    args = parser.parse_args()
    if not (DATA / "meta.json").exists():
        from moelab.data.prepare import ensure_default_corpus

        ensure_default_corpus(DATA)
    os.environ.update(DRIVER_ENV)
    before, waited = settle()
    rows = {"sequential": timed("one process")}
    for nodes in (1, 2, 3):
        with LocalCluster(workers=nodes) as cluster:
            rows[f"ray_{nodes}_nodes"] = timed(f"ray, {nodes} node(s)", ray=cluster.address)
    n = rows["sequential"]["runs"]
    overhead = (rows["ray_1_nodes"]["wall_s"] - rows["sequential"]["wall_s"]) / n
    same = len({(r["predicted"], r["actual"]) for r in rows.values()}) == 1
    machine = describe(before, load_per_core(), waited)
    result = {"machine": machine, "rows": rows, "overhead_per_task_s": round(overhead, 2),
              "speedup_2_nodes": round(rows["ray_1_nodes"]["wall_s"]
                                       / rows["ray_2_nodes"]["wall_s"], 3),
              "speedup_3_nodes": round(rows["ray_1_nodes"]["wall_s"]
                                       / rows["ray_3_nodes"]["wall_s"], 3),
              "same_numbers_everywhere": same, "cores": os.cpu_count()}
    print(json.dumps(result, indent=1))
    refuse_if_busy(machine, args.force)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main)
