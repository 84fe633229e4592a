"""Executors: run one stage's shard tasks serially, on a local process pool, or on Ray.

A task reads its input shards from the stage directory and writes its output shards
there itself; it returns only a small summary (counts). So the data moves through the
filesystem, never through the driver: on a Ray cluster the dataset directory must be a
path every node sees (NFS, a cloud bucket mounted with FUSE, ...), and the driver holds
one summary per shard, not the corpus.

Every task also reports its process's peak RSS while it ran (`measured`), and the
executor keeps the largest per stage (`peak_rss_mb`): memory growth is located by stage,
not guessed from one high-water mark of a long-lived worker.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from moelab.errors import UserError

Task = Callable[[], Any]  # a picklable zero-argument callable (a functools.partial)
_HWM = re.compile(r"VmHWM:\s+(\d+) kB")
try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim  # glibc's; absent on other C libraries
except (AttributeError, OSError, TypeError):
    _MALLOC_TRIM = None


def reset_peak_rss() -> None:
    """Hand back what earlier work freed, then restart this process's RSS high-water mark
    from its current RSS (Linux >= 4.0; elsewhere the mark keeps counting from the process
    start, an upper bound). Without the trim, a long-lived worker keeps the heap of its
    largest task so far, in every malloc arena (the tokenizers' Rust threads allocate
    through malloc too), and each later task's peak starts from there."""
    pa.default_memory_pool().release_unused()  # Arrow's own allocator (mimalloc) keeps it
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """This process's RSS high-water mark (VmHWM) in MB since the last reset; 0 where
    /proc is missing."""
    try:
        with open("/proc/self/status") as file:
            found = _HWM.search(file.read())
    except OSError:
        return 0.0
    return round(int(found.group(1)) / 1024, 1) if found else 0.0


def measured(task: Task) -> tuple[Any, float]:
    """The task's result and the peak RSS (MB) of the process while it ran."""
    reset_peak_rss()
    try:
        result = task()
    except StopIteration as err:  # escaping into map/imap it would end the stage silently
        raise RuntimeError(f"a task raised StopIteration: {err!r}") from err
    return result, peak_rss_mb()


class Executor:
    """Local: tasks on `workers` spawn-started processes (fork is unsafe once JAX or
    tokenizers threads exist in the parent), serially when workers == 1."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or os.cpu_count() or 1
        self._pool: Any = None
        self.peak_rss_mb: dict[str, float] = {}  # stage -> largest peak of one of its tasks
        self.seconds: dict[str, float] = {}  # stage -> wall seconds of its maps

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()

    def map(self, tasks: Sequence[Task], desc: str) -> list[Any]:
        """Every task's result, in task order."""
        with self.timed(desc):
            return self._map(tasks, desc)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall seconds of the block to `seconds[stage]` (driver work too)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = round(self.seconds.get(stage, 0.0)
                                        + time.perf_counter() - start, 2)

    def _map(self, tasks: Sequence[Task], desc: str) -> list[Any]:
        if self.workers == 1 or len(tasks) <= 1:
            results = map(measured, tasks)
        else:
            if self._pool is None:  # started once, on first need, for every stage
                self._pool = multiprocessing.get_context("spawn").Pool(
                    self.workers, initializer=_start_worker)
            results = self._pool.imap(measured, tasks, chunksize=1)
        return self._record(desc, list(tqdm(results, total=len(tasks), desc=desc, unit="shard")))

    def _record(self, desc: str, measured_results: list[tuple[Any, float]]) -> list[Any]:
        """Keep the stage's largest task peak; return the bare results."""
        peaks = [peak for _, peak in measured_results]
        self.peak_rss_mb[desc] = max([self.peak_rss_mb.get(desc, 0.0), *peaks])
        return [result for result, _ in measured_results]


class _NoPandas:
    """An import finder that says pandas is not installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "pandas":
            raise ModuleNotFoundError("pandas is not imported in a pool worker", name=name)


def _start_worker() -> None:
    """Pool worker start. Ctrl-C reaches the whole process group: a worker ignores SIGINT
    and leaves the stop to the driver, which terminates the pool (no traceback per worker,
    no pool left waiting for a task that died with its worker). Stage tasks never convert
    to pandas, but pyarrow imports it (~0.5 s of CPU a process) at its first pa.array only
    to check whether the input is a pandas object. A worker of ours runs nothing else, so
    it skips that import."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.meta_path.insert(0, _NoPandas())


class RayExecutor(Executor):
    """Ray Data: one row per task, mapped on the cluster `ray.init()` connects to
    (RAY_ADDRESS, or a local runtime when unset); results stream back with iter_rows."""

    def __init__(self) -> None:
        super().__init__(workers=1)
        try:
            import ray
            import ray.data  # noqa: F401  (the extra `ray[data]` brings it)
        except ImportError as err:
            raise UserError("--ray needs Ray Data installed: pip install -e '.[ray]'") from err
        if not ray.is_initialized():
            ray.init()

    def _map(self, tasks: Sequence[Task], desc: str) -> list[Any]:
        import ray.data

        if not tasks:
            return []
        rows = ray.data.from_items([{"index": i} for i in range(len(tasks))],
                                   override_num_blocks=len(tasks))
        results: list[Any] = [None] * len(tasks)
        for row in tqdm(rows.map(partial(_ray_row, tasks=list(tasks))).iter_rows(),
                        total=len(tasks), desc=desc, unit="shard"):
            results[row["index"]] = json.loads(row["result"])
        return self._record(desc, results)


def _ray_row(row: dict, tasks: list[Task]) -> dict:
    # JSON, so that summaries of any shape pass through Ray's Arrow blocks unchanged
    return {"index": row["index"], "result": json.dumps(measured(tasks[row["index"]]))}
