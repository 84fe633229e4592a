"""Turn SIGTERM/SIGINT (and the supervisor's death) into "finish this step, save, exit":
preemption loses no work.

Preemptible machines get SIGTERM shortly before they are taken away, and Ctrl-C is
SIGINT. Either one only sets a flag; the step loop checks it after each step, saves a
checkpoint and stops with `errors.Interrupted`. A second signal while that save runs
exits at once (the checkpoint being written is a temporary directory, removed on the
next start, and the previous one is intact).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from moelab.errors import EXIT_INTERRUPTED

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What a supervised worker gets when its supervisor dies (supervisor.py sets it with
# PR_SET_PDEATHSIG). Not SIGTERM: the kernel sends the parent-death signal each time the
# worker is re-parented, and a dying multi-threaded parent re-parents it to each of its
# threads in turn as they exit, so it can arrive several times within microseconds. A
# second SIGTERM means "exit at once"; repeats of this one only ask for the stop again.
PARENT_DIED = signal.SIGUSR1
STOPPING = (*SIGNALS, PARENT_DIED)  # every signal that asks a run to stop


def describe(signum: int) -> str:
    """What a stop signal means, for the message and the run's `interrupted` event."""
    return ("the supervisor died" if signum == PARENT_DIED else
            f"{signal.Signals(signum).name} received")


class StopRequest:
    """Context manager that records the first SIGTERM/SIGINT in `self.signal`."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None:
            if signum == PARENT_DIED:
                return  # the same parent death, delivered again
            os._exit(EXIT_INTERRUPTED)
        self.signal = signum
        print(f"{describe(signum)}: finishing this step and saving a checkpoint (send "
              "SIGTERM or SIGINT again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be installed from the main thread (a trainer run
        # from a worker thread, as in tests, just is not interruptible this way).
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOPPING}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _raise_interrupt(signum: int, frame) -> None:
    # Once: a second signal (Ctrl-C pressed twice, or the supervisor forwarding the one
    # its worker already got from the terminal) must not interrupt the unwinding.
    for s in STOPPING:
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def stop_at_once() -> Iterator[None]:
    """SIGTERM/SIGINT raise KeyboardInterrupt at once, for work with no step to finish
    (preparing the corpus): its stages skip the tasks whose outputs exist, so stopping
    anywhere loses at most the tasks in flight. SIGTERM's default would kill the process
    without unwinding, leaving the worker pool to be reaped by nobody."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupt) for s in STOPPING}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
