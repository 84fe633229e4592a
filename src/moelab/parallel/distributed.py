"""Multi-host start-up: join this process to the others before any jax computation.

The same program runs on every host; `jax.distributed.initialize` connects them through
the coordinator (process 0), after which `jax.devices()` lists every host's devices and
`make_mesh` builds one global mesh over them. Each field comes from the config or, if
left empty there, from the environment (so one config serves every host and a launcher
sets only the process id):

    distributed.coordinator_address  MOELAB_COORDINATOR     host:port of process 0
    distributed.num_processes        MOELAB_NUM_PROCESSES   0/1 = single process
    distributed.process_id           MOELAB_PROCESS_ID      0 .. num_processes - 1

On CPU, cross-process collectives go through gloo (jax's default there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from moelab.config import ConfigError, DistributedConfig


@dataclass(frozen=True)
class Cluster:
    coordinator_address: str
    num_processes: int
    process_id: int


def resolve(cfg: DistributedConfig, env: dict[str, str] | None = None) -> Cluster | None:
    """The cluster this process belongs to, or None for a single process."""
    env = os.environ if env is None else env
    address = cfg.coordinator_address or env.get("MOELAB_COORDINATOR", "")
    count = cfg.num_processes or _int_env(env, "MOELAB_NUM_PROCESSES", 0)
    rank = cfg.process_id if cfg.process_id >= 0 else _int_env(env, "MOELAB_PROCESS_ID", -1)
    given = {"distributed.coordinator_address (or MOELAB_COORDINATOR)": bool(address),
             "distributed.num_processes (or MOELAB_NUM_PROCESSES)": count > 1,
             "distributed.process_id (or MOELAB_PROCESS_ID)": rank >= 0}
    if count == 1 or not any(given.values()):
        return None  # one process needs no coordinator
    missing = [name for name, ok in given.items() if not ok]
    if missing:
        raise ConfigError(f"distributed: a multi-process run needs all three fields; "
                          f"missing {', '.join(missing)} (num_processes must be > 1)")
    if rank >= count:
        raise ConfigError(f"distributed.process_id: {rank} must be < num_processes={count}")
    return Cluster(address, count, rank)


def _int_env(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r} is not an integer") from None


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """Call jax.distributed.initialize when this is a multi-process run; True if it was."""
    cluster = resolve(cfg)
    if cluster is None:
        return False
    jax.distributed.initialize(coordinator_address=cluster.coordinator_address,
                               num_processes=cluster.num_processes,
                               process_id=cluster.process_id)
    return True
