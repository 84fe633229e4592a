"""What every speed benchmark records about the machine, and its refusal to time a busy one.

These are shared 2-core machines: a ratio measured while other work runs is distorted
(PyTorch's threads suffer more than XLA's, for one), so a benchmark first waits for the
machine to be quiet (`settle`: up to SETTLE_LIMIT_S, printing what it waited), records the
load before and after, and writes no results when the machine was still busy when it
started (above BUSY_PER_CORE) unless forced.

The load is sampled from /proc/stat (the fraction of all cores' time spent busy over the
last second), not read from the 1-minute load average: that average stays high for a
minute or two after the previous benchmark ended, which made back-to-back benchmarks
refuse to run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

BUSY_PER_CORE = 0.5
QUIET_PER_CORE = 0.15  # settle() waits for less than this much busy time per core
SETTLE_LIMIT_S = float(os.environ.get("MOELAB_BENCH_SETTLE_S", 300))  # the most settle() waits


def _cpu_times() -> tuple[int, int, int] | None:
    """(busy, niced, total) jiffies of all cores since boot; None without /proc/stat.
    `busy` excludes time of positively niced processes, which is `niced`."""
    try:
        with open("/proc/stat") as file:
            fields = [int(v) for v in file.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle - fields[1], fields[1], sum(fields)


def cpu_use(window_s: float = 1.0) -> tuple[float, float]:
    """(busy, niced) fractions of the machine's cores over the next `window_s` seconds."""
    first = _cpu_times()
    if first is None:
        return os.getloadavg()[0] / (os.cpu_count() or 1), 0.0
    time.sleep(window_s)
    second = _cpu_times()
    total = max(second[2] - first[2], 1)
    return (second[0] - first[0]) / total, (second[1] - first[1]) / total


def load_per_core(window_s: float = 1.0) -> float:
    """Busy fraction of the machine's cores over the next `window_s` seconds (0 = idle,
    1 = every core busy), not counting niced processes: a background job at nice 19 has
    CFS weight 15 against a benchmark's 1024, so it takes ~1.5% of a contended core (it
    still shares caches and memory bandwidth: `describe` records it as `niced`)."""
    return cpu_use(window_s)[0]


def settle(limit_s: float = SETTLE_LIMIT_S) -> tuple[float, float]:
    """Wait until the machine is quiet (at most limit_s): (load per core, seconds waited).
    Prints what it waited for, so a slow start is never a mystery."""
    started = time.perf_counter()
    load = load_per_core()
    while load > QUIET_PER_CORE and time.perf_counter() - started < limit_s:
        print(f"[bench] waiting for the machine to settle: {100 * load:.0f}% of the cores "
              "busy", flush=True)
        time.sleep(4.0)
        load = load_per_core()
    waited = time.perf_counter() - started
    print(f"[bench] load {load:.2f} per core after waiting {waited:.0f} s", flush=True)
    return load, round(waited, 1)


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


def describe(load_before: float, load_after: float, waited_s: float = 0.0) -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(),
            "load_per_core": {"before": round(load_before, 2), "after": round(load_after, 2),
                              "niced_now": round(cpu_use()[1], 2),
                              "measured": "busy fraction of all cores over 1 s (/proc/stat), "
                                          "niced processes apart"},
            "waited_for_quiet_s": waited_s,
            # only the load before counts: during and after, the benchmark's own threads
            # keep both cores busy, which is the point of running it
            "busy": load_before > BUSY_PER_CORE}


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of each round's own ratio. Times taken side by side in one
    round share that moment's machine state; on these VMs the state drifts between
    stretches of rounds, which a ratio of the two medians mixes in."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def run_main(main: Callable[[], int | None]) -> None:
    """Runs a benchmark's main as `moelab` runs a command: bad input (a corpus not
    prepared, a spec that does not load) ends in one line and exit 2, a stop that saved its
    work (SIGTERM to a ladder's training run) in one line and exit 130, never a traceback."""
    from moelab.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, Interrupted, UserError
    from moelab.schema import bounded

    name = Path(sys.argv[0]).name or "bench"
    try:
        code = main()
    except UserError as err:
        print(bounded(f"{name}: error: {err}"), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except Interrupted as stop:
        print(f"{name}: {stop}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code or 0)


def add_output_args(parser: argparse.ArgumentParser, default: Path) -> None:
    """--out, the JSON file to write, and --force, to write it from a busy machine."""
    parser.add_argument("--out", type=Path, default=default)
    parser.add_argument("--force", action="store_true",
                        help="write results even if the machine is busy")


def refuse_if_busy(machine: dict, force: bool) -> None:
    """Exit without writing results when the machine was busy, unless --force."""
    if machine["busy"] and not force:
        load = machine["load_per_core"]["before"]
        raise SystemExit(f"machine busy (load {load:.2f} per core > {BUSY_PER_CORE}): results "
                         "not written; rerun on an idle machine or pass --force")


def quiet_start(force: bool) -> float:
    """The machine's load before a long benchmark, which exits without running on a busy
    machine unless `force` (refuse_if_busy); hand it to write_result at the end."""
    before = load_per_core()
    refuse_if_busy(describe(before, before), force)
    return before


def write_result(path: Path, result: dict, before: float) -> dict:
    """`result` with the machine it ran on (its load `before` and now) as JSON at `path`."""
    out = {**result, "machine": describe(before, load_per_core())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def timed(call) -> float:
    """Seconds one call of `call()` takes."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def matmul_timer(n: int = 2048):
    """A call that times one jitted n x n float32 matmul (compiled here) and returns its
    FLOP/s; timing it between the reps of a bench puts the peak and the bench side by side."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()

    def rate() -> float:
        t = time.perf_counter()
        dot(a, a).block_until_ready()
        return 2 * n**3 / (time.perf_counter() - t)

    return rate


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a jitted n x n float32 matmul: the ceiling MFU is measured against."""
    rate = matmul_timer(n)
    return statistics.median(rate() for _ in range(reps))
