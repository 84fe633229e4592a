"""Restart a crashed training worker from its last checkpoint, without a human.

The supervisor runs the same `moelab train` command as a child process. A worker that
dies of anything but bad input (exit 2) or divergence (exit 3) is restarted after an
exponential backoff; since the trainer resumes from its last checkpoint by itself, a
hardware fault costs the steps since that checkpoint plus a restart. Every fault is
logged as a `restart` event; after `max_restarts` the supervisor gives up, loudly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from moelab.train.runlog import RunLog

NO_RETRY = {0: "finished", 2: "bad input", 3: "divergence"}
WORKER_PID_FILE = "worker.pid"


def supervise(worker_argv: list[str], run_dir: Path, max_restarts: int,
              backoff_s: float = 1.0, experiment: str | None = None) -> int:
    """Run `moelab <worker_argv>` until it finishes, restarting it up to max_restarts times."""
    run_dir.mkdir(parents=True, exist_ok=True)
    restarts = 0
    while True:
        worker = subprocess.Popen([sys.executable, "-m", "moelab.cli", *worker_argv])
        (run_dir / WORKER_PID_FILE).write_text(str(worker.pid))
        code = worker.wait()
        if code in NO_RETRY:
            return code
        log = RunLog(run_dir, experiment, {})
        step = last_step(log)
        if restarts >= max_restarts:
            message = (f"worker failed (exit {code}) after {restarts} restarts; giving up. "
                       f"The last checkpoint in {run_dir / 'checkpoints'} is intact.")
            log.event(step, "gave_up", message)
            log.finish("failed", message)
            print(f"moelab train: {message}", file=sys.stderr)
            return 1
        restarts += 1
        wait = backoff_s * 2 ** (restarts - 1)
        message = (f"worker died (exit {code}) near step {step}; "
                   f"restart {restarts}/{max_restarts} in {wait:.1f}s")
        log.event(step, "restart", message)
        print(f"moelab train: {message}", file=sys.stderr, flush=True)
        time.sleep(wait)


def last_step(log: RunLog) -> int:
    records = log.metrics.read()
    return records[-1]["step"] if records else 0
