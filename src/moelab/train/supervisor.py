"""Restart a crashed training worker from its last checkpoint, without a human.

The supervisor runs the same `moelab train` command as a child process. A worker that
dies of anything but bad input, divergence or an interruption is restarted after an
exponential backoff; since the trainer resumes from its last checkpoint by itself, a
hardware fault costs the steps since that checkpoint plus a restart. Every fault is
logged as a `restart` event; after `max_restarts` the supervisor gives up, loudly.

The worker never outlives the supervisor: it runs in its own session (so a terminal's
Ctrl-C reaches it once, forwarded, not twice) and asks the kernel for a signal when its
parent dies (Linux `PR_SET_PDEATHSIG`; `interrupt.PARENT_DIED`, which may arrive more than
once), which makes it save a checkpoint and exit.
SIGTERM/SIGINT sent to the supervisor are forwarded to the worker, and the run counts
as stopped, not crashed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moelab.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR
from moelab.train.interrupt import PARENT_DIED, SIGNALS
from moelab.train.rundir import WORKER_PID_FILE, RunDirLock

NO_RETRY = {EXIT_OK: "finished", EXIT_USER_ERROR: "bad input", EXIT_DIVERGED: "divergence",
            EXIT_INTERRUPTED: "stopped"}
if TYPE_CHECKING:
    from moelab.train.runlog import RunLog

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
MAX_WAIT_S = 3600.0  # the backoff doubles up to this many seconds between restarts


def _die_with_parent(parent: int) -> None:
    """In the forked worker, before exec: signal me when the supervisor dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(PARENT_DIED), 0, 0, 0)
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(EXIT_INTERRUPTED)


def supervise(worker_argv: list[str], run_dir: Path, max_restarts: int,
              backoff_s: float = 1.0, experiment: str | None = None) -> int:
    """Run `moelab <worker_argv>` until it finishes, restarting it up to max_restarts times."""
    from moelab.train.runlog import RunLog  # here: `moelab train --help` imports this module

    run_dir.mkdir(parents=True, exist_ok=True)
    with RunDirLock(run_dir):  # a run dir in use is refused before worker.pid is touched
        pass
    restarts, stopping, worker = 0, [], None

    def forward(signum: int, frame) -> None:
        stopping.append(signum)
        if worker is not None and worker.poll() is None:
            worker.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in SIGNALS}
    parent = os.getpid()
    try:
        while True:
            worker = subprocess.Popen([sys.executable, "-m", "moelab.cli", *worker_argv],
                                      start_new_session=True,
                                      preexec_fn=lambda: _die_with_parent(parent))
            (run_dir / WORKER_PID_FILE).write_text(str(worker.pid))
            code = worker.wait()
            if code in NO_RETRY or stopping:
                return code if code >= 0 else EXIT_INTERRUPTED
            log = RunLog(run_dir, experiment, {})
            step = last_step(log)
            if restarts >= max_restarts:
                message = (f"worker failed (exit {code}) after {restarts} restarts; giving up. "
                           f"The last good checkpoint in {run_dir} is kept.")
                log.event(step, "gave_up", message)
                log.finish("failed", message)
                print(f"moelab train: {message}", file=sys.stderr)
                return EXIT_FAILED
            restarts += 1
            wait = min(backoff_s * 2.0 ** min(restarts - 1, 64), MAX_WAIT_S)
            message = (f"worker died (exit {code}) near step {step}; "
                       f"restart {restarts}/{max_restarts} in {wait:.1f}s")
            log.event(step, "restart", message)
            print(f"moelab train: {message}", file=sys.stderr, flush=True)
            time.sleep(wait)
            if stopping:
                return EXIT_INTERRUPTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def last_step(log: RunLog) -> int:
    records = log.metrics.read()
    return records[-1]["step"] if records else 0
