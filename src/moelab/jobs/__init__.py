"""Run a set of training jobs, in this process or on a Ray cluster: one interface.

A ladder (or a comparison, a sweep, a proxy swarm) only *describes* its runs: a `Job` is a
picklable function with its arguments, the jobs whose results it waits for, the resources
it needs and the run directory it writes. `run_jobs(jobs, ray=None)` runs them in order in
this process; `run_jobs(jobs, ray="HOST:PORT")` submits each as a Ray task and waits,
printing a progress table. Both return {name: result}, and because a job's result is a
pure function of its config (moelab's training is deterministic), the numbers are the
same either way.

Every job wraps its function in `run_attempt`, which records each attempt (node, pid, the
checkpoint it resumes from and the steps lost since) in `<run_dir>/attempts.jsonl`: the
progress table and the fault-tolerance tests read that file, so they work across nodes
through the shared filesystem the run directories must live on.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.errors import UserError

ATTEMPTS_FILE = "attempts.jsonl"  # one JSON line per attempt at a job, in its run dir
TASK_LOG = "task.log"  # a Ray task's stdout and stderr, in its run dir
LOCK_WAIT_S = 120.0  # how long a retried attempt waits for a dead attempt's lock


@dataclass(frozen=True)
class Job:
    """One run to execute: `fn(*args, *results of after)` in `cwd`."""

    name: str
    fn: Callable[..., Any]  # a module-level function (Ray pickles it by reference)
    args: tuple = ()
    after: tuple[str, ...] = ()  # jobs whose results are appended to args, in this order
    run_dir: Path | None = None  # where the job writes; its attempts are recorded there
    cpus: float = 1.0
    memory_bytes: int = 0  # a floor estimate (moelab.train.memory); 0 = unknown
    cwd: str = field(default_factory=os.getcwd)  # relative config paths resolve here


def run_jobs(jobs: Sequence[Job], ray: str | None = None, **ray_options: Any) -> dict[str, Any]:
    """Run every job once its dependencies are done; {name: result}. `ray`: None runs them
    here in order; "local" starts a Ray runtime on this machine; otherwise the address of a
    running cluster's head (HOST:PORT)."""
    check_graph(jobs)
    if ray is None:
        return run_local(jobs)
    from moelab.jobs.ray_runner import run_on_ray

    return run_on_ray(jobs, ray, **ray_options)


def check_graph(jobs: Sequence[Job]) -> None:
    """Unique names; every dependency is an earlier job (so in-order execution is valid)."""
    seen: set[str] = set()
    for job in jobs:
        if job.name in seen:
            raise UserError(f"two jobs are named {job.name!r}")
        missing = [a for a in job.after if a not in seen]
        if missing:
            raise UserError(f"job {job.name} waits for {', '.join(missing)}, which is not "
                            "an earlier job")
        seen.add(job.name)


def run_local(jobs: Sequence[Job]) -> dict[str, Any]:
    """In order, in this process and directory: exactly what a plain loop would do."""
    done: dict[str, Any] = {}
    for job in jobs:
        done[job.name] = job.fn(*job.args, *(done[a] for a in job.after))
    return done


# ------------------------------------------------------------------ one attempt


def run_attempt(job: Job, *deps: Any, node: str = "", log: bool = False) -> Any:
    """Execute one attempt at `job` (in whatever process or node runs it): record it, wait
    for any earlier attempt's run-dir lock to be released, then call the function.

    `log`: send this attempt's output to <run_dir>/task.log (a Ray worker has no terminal).
    """
    if job.run_dir is not None:
        run_dir = Path(job.cwd, job.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        record_attempt(run_dir, node or socket.gethostname())
        wait_for_lock(run_dir, LOCK_WAIT_S)
    stream = (open(Path(job.cwd, job.run_dir, TASK_LOG), "a", buffering=1)  # noqa: SIM115
              if log and job.run_dir is not None else None)
    with _in_dir(job.cwd), _redirect(stream):
        return job.fn(*job.args, *deps)


def record_attempt(run_dir: Path, node: str) -> dict[str, Any]:
    """Append this attempt to attempts.jsonl: where it runs, the checkpoint it will resume
    from and how many logged steps past that checkpoint the previous attempt lost."""
    from moelab.train.rundir import CHECKPOINT_DIR, METRICS_FILE

    ckpts = run_dir / CHECKPOINT_DIR
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if \
        ckpts.is_dir() else []
    last_logged = 0
    metrics = run_dir / METRICS_FILE
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                last_logged = max(last_logged, int(json.loads(line).get("step", 0)))
    before = attempts(run_dir)
    resume = steps[-1] if steps else 0
    entry = {"attempt": len(before) + 1, "node": node, "pid": os.getpid(),
             "started": time.time(), "resumes_at": resume,
             "lost_steps": max(last_logged - resume, 0) if before else 0}
    with open(run_dir / ATTEMPTS_FILE, "a") as file:
        file.write(json.dumps(entry) + "\n")
    return entry


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / ATTEMPTS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                out.append(entry)
    return out


def wait_for_lock(run_dir: Path, timeout_s: float) -> None:
    """Wait until no trainer holds run_dir's lock (an attempt on a lost node may hold it
    until its process is gone or, on NFS, its lease expires), then return unlocked."""
    from moelab.train.rundir import LOCK_FILE

    path, deadline = run_dir / LOCK_FILE, time.monotonic() + timeout_s
    if not path.exists():
        return
    fd = os.open(path, os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise UserError(f"{run_dir} stayed locked by another trainer for "
                                    f"{timeout_s:.0f} s; is a previous attempt still "
                                    "running?") from None
                time.sleep(1.0)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _in_dir(path: str):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _redirect(stream: io.TextIOBase | None):
    if stream is None:
        yield
        return
    with stream, contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        yield
    sys.stdout.flush()
