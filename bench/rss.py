"""Peak RSS of a process tree, sampled: what the data benches report as memory.

Sampled (every 0.2 s, the RSS of the root process plus its descendants summed, and the
largest single process), not read from /usr/bin/time or getrusage: prepare's executor
resets each worker's and the driver's high-water mark between tasks and phases
(clear_refs), so a process's VmHWM or ru_maxrss is not its lifetime peak. A sample can
miss a spike shorter than its period: the figures are a lower bound within ~0.2 s.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def rss_mb(pid: int) -> float:
    """The process's resident set now (VmRSS), 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as file:
            for line in file:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    """Every process below pid (children of all its threads, recursively)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as file:
                    kids = [int(c) for c in file.read().split()]
                found += kids
                todo += kids
        except OSError:
            continue
    return found


class Sampler:
    """Peak RSS (MB) of a process tree, sampled on a thread: `total` (the tree's sum) and
    `single` (its largest process)."""

    def __init__(self, every: float = 0.2) -> None:
        self.every, self.total, self.single = every, 0.0, 0.0
        self._stop = threading.Event()

    @contextmanager
    def running(self, root: int | None = None) -> Iterator[Sampler]:
        """Sample the tree under root (default: this process) until the block ends."""
        self.total = self.single = 0.0
        self._stop.clear()
        thread = threading.Thread(target=self._loop, args=(root or os.getpid(),), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()

    def _loop(self, root: int) -> None:
        while not self._stop.is_set():
            sizes = [rss_mb(p) for p in [root, *descendants(root)]]
            self.total = max(self.total, sum(sizes))
            self.single = max(self.single, max(sizes))
            time.sleep(self.every)

    def figures(self) -> dict[str, float]:
        return {"peak_rss_mb_tree": round(self.total, 1),
                "peak_rss_mb_one_process": round(self.single, 1)}


def run_sampled(argv: list[str]) -> tuple[str, dict[str, float]]:
    """Run argv in a fresh process, its tree sampled throughout; its stdout and the
    sampled figures. A failure raises with the end of its stderr."""
    sampler = Sampler()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as child:
        with sampler.running(child.pid):
            stdout, stderr = child.communicate()
    if child.returncode:
        raise RuntimeError(stderr[-3000:])
    return stdout, sampler.figures()
