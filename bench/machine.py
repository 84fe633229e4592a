"""What every speed benchmark records about the machine, and its refusal to time a busy one.

These are shared 2-core machines: a ratio measured while other work runs is distorted
(PyTorch's threads suffer more than XLA's, for one), so a benchmark records the load
average before and after and writes no results when the machine was busy before it
started (above BUSY_PER_CORE) unless forced.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

BUSY_PER_CORE = 0.5


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which speed ratios depend on; the architecture
    where that file is missing."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(load_before: float, load_after: float) -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(),
            "load_per_core": {"before": round(load_before, 2), "after": round(load_after, 2)},
            # only the load before counts: during and after, the benchmark's own threads
            # keep both cores busy, which is the point of running it
            "busy": load_before > BUSY_PER_CORE}


def refuse_if_busy(machine: dict, force: bool) -> None:
    """Exit without writing results when the machine was busy, unless --force."""
    if machine["busy"] and not force:
        load = machine["load_per_core"]["before"]
        raise SystemExit(f"machine busy (load {load:.2f} per core > {BUSY_PER_CORE}): results "
                         "not written; rerun on an idle machine or pass --force")


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a jitted n x n float32 matmul: the ceiling MFU is measured against."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dot(a, a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)
