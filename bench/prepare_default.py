"""What `moelab train` waits for the first time: the default corpus prepared from scratch,
this tree against a reference commit, side by side in one run.

    python3 bench/prepare_default.py [--reps 3] [--reference COMMIT] [--force]

The reference defaults to the last commit before the staged data pipeline (the first
parent of the oldest commit touching src/moelab/data/stages.py). Its src/ is exported
with `git archive` into a temporary directory (a detached copy: no worktree entry is
added to the shared repository) and run with PYTHONPATH pointing at it. Each prepare runs
in a fresh process, alternating this/reference (A/B/A/B...) so that a change in the
machine's load hits both alike; both the prepare call and the whole process (imports
included, which `moelab train` also pays) are timed, and the CPU seconds of each process
with its workers are recorded. The load average is recorded; on a busy machine no results
are written unless --force. Writes bench/results/benchmarks/prepare_default.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from machine import describe, load_per_core, refuse_if_busy, settle  # bench/machine.py

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "benchmarks" / "prepare_default.json"
STAGES = "src/moelab/data/stages.py"
CHILD = ("import sys, time; from moelab.data.prepare import ensure_default_corpus; "
         "start = time.perf_counter(); ensure_default_corpus(sys.argv[1]); "
         "print(time.perf_counter() - start)")


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def default_reference() -> str:
    """The first parent of the oldest commit that touched the stages module."""
    oldest = git("log", "--format=%H", "--reverse", "--", STAGES).splitlines()[0]
    return git("rev-parse", f"{oldest}^1")


def export_src(commit: str, into: Path) -> Path:
    """The commit's src/ under `into` (git archive | tar), its path for PYTHONPATH."""
    archive = into / "src.tar"
    with open(archive, "wb") as file:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "src"],
                       stdout=file, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    return into / "src"


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(src: Path, out: Path) -> dict:
    """One default-corpus prepare in a fresh process: prepare and whole-process seconds,
    and the CPU seconds of the process and its pool workers (less sensitive to other
    work on the machine than wall time, though not immune: caches, frequency)."""
    start, cpu = time.perf_counter(), cpu_seconds_of_children()
    done = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(src)}, check=False)
    process, cpu = time.perf_counter() - start, cpu_seconds_of_children() - cpu
    if done.returncode:
        raise SystemExit(f"prepare with PYTHONPATH={src} failed:\n{done.stderr[-3000:]}")
    meta = json.loads((out / "meta.json").read_text())
    tokens = sum(sum(meta[f"{split}_tokens"].values()) for split in ("train", "val"))
    return {"prepare": round(float(done.stdout.split()[-1]), 3), "process": round(process, 3),
            "cpu": round(cpu, 3), "tokens": tokens}


def summary(runs: list[dict]) -> dict:
    return {key: {"runs": [r[key] for r in runs], "median": statistics.median(r[key] for r in runs)}
            for key in ("prepare", "process", "cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="fresh runs of each tree")
    parser.add_argument("--reference", default=None, help="commit to compare against")
    parser.add_argument("--force", action="store_true",
                        help="write results even if the machine is busy")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON to write")
    args = parser.parse_args()
    reference = git("rev-parse", args.reference) if args.reference else default_reference()
    load_before, waited = settle()
    trees: dict[str, list[dict]] = {"this": [], "reference": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        srcs = {"this": ROOT / "src", "reference": export_src(reference, tmp)}
        for rep in range(args.reps):
            for name in trees:  # A/B/A/B: alternate, so that load drifts hit both
                run = run_once(srcs[name], tmp / f"{name}-{rep}")
                trees[name].append(run)
                print(f"rep {rep} {name:>9}: prepare {run['prepare']:.2f} s, process "
                      f"{run['process']:.2f} s, CPU {run['cpu']:.2f} s, {run['tokens']} tokens",
                      flush=True)
    this, ref = summary(trees["this"]), summary(trees["reference"])
    result = {
        "this_commit": git("rev-parse", "HEAD"), "this_dirty": bool(git("status", "--porcelain",
                                                                          "src")),
        "reference_commit": reference, "reps": args.reps, "this": this, "reference": ref,
        # medians of alternated fresh runs: one slow outlier (a load spike) does not decide
        "ratio_this_over_reference": {
            key: round(this[key]["median"] / ref[key]["median"], 3) for key in this},
        "machine": describe(load_before, load_per_core(), waited),
    }
    ratio = result["ratio_this_over_reference"]
    print(f"this / reference (medians): prepare {ratio['prepare']}, whole process "
          f"{ratio['process']}, CPU {ratio['cpu']}")
    refuse_if_busy(result["machine"], args.force)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
