"""`run_on_ray(jobs, address)`: every job a Ray task, dependencies as object references.

Fault tolerance is Ray's own retry of a task whose worker or node died (`max_retries`),
combined with moelab's resume: the retried attempt trains in the same run directory (on a
path every node sees), so the trainer resumes from the newest verified checkpoint and a
lost node costs only the steps since it. An exception raised by the job itself (a config
error, a divergence) is deterministic and is *not* retried (`retry_exceptions=False`):
it fails the whole set with its own message. Two attempts never train one run at once:
Ray starts a retry only once the first attempt's worker is gone, and each attempt waits
for the run directory's lock (`moelab.jobs.wait_for_lock`) before training.

Every wait has a limit: the head must answer a TCP connect within `connect_timeout_s`,
each node must answer the shared-path probe within `probe_timeout_s`, and the set fails
if no run changes state or step for `stall_timeout_s`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab.errors import UserError
from moelab.jobs import Job, attempts, run_attempt

FORWARDED_ENV = ("MOELAB_", "JAX_", "XLA_FLAGS")  # the driver's settings the tasks need
SHOW_EVERY_S = 60.0  # the table is printed on every state change and at least this often


def run_on_ray(jobs: Sequence[Job], address: str, *, max_retries: int = 3,
               connect_timeout_s: float = 10.0, probe_timeout_s: float = 60.0,
               stall_timeout_s: float = 3600.0, poll_s: float = 1.0) -> dict[str, Any]:
    ray = _import_ray()
    connect(ray, address, connect_timeout_s)
    try:
        nodes = worker_nodes(ray)
        check_resources(jobs, nodes)
        check_shared_paths(ray, jobs, nodes, probe_timeout_s)
        remote = ray.remote(_attempt_on_node)
        refs: dict[str, Any] = {}
        for job in jobs:
            options: dict[str, Any] = {"num_cpus": job.cpus, "max_retries": max_retries,
                                       "retry_exceptions": False, "name": job.name}
            if job.memory_bytes:
                options["memory"] = job.memory_bytes
            refs[job.name] = remote.options(**options).remote(
                job, *(refs[a] for a in job.after))
        return wait_all(ray, jobs, refs, stall_timeout_s, poll_s)
    finally:
        ray.shutdown()


def _import_ray():
    try:
        import ray
    except ModuleNotFoundError:
        raise UserError("--ray needs Ray: pip install -e '.[ray]'") from None
    return ray


def connect(ray, address: str, timeout_s: float) -> None:
    """Join the cluster at HOST:PORT ("local": start a runtime on this machine). The head
    is probed with a plain TCP connect first, so a wrong address fails in seconds."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    common = {"log_to_driver": False, "logging_level": logging.WARNING,
              "runtime_env": {"env_vars": env}, "include_dashboard": False}
    if address == "local":
        ray.init(num_cpus=os.cpu_count(), **common)
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {address}: expected HOST:PORT of the Ray head (e.g. "
                        "127.0.0.1:6379), or no value to start Ray on this machine")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise UserError(f"cannot reach the Ray head at {address} within {timeout_s:.0f} s "
                        f"({err.strerror or err}); start it with `ray start --head "
                        f"--port {port}` or check the address") from None
    ray.init(address=address, **common)


def worker_nodes(ray) -> list[dict[str, Any]]:
    """The alive nodes that can run a task (CPU > 0)."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    if not nodes:
        raise UserError("the Ray cluster has no alive node with a CPU to run on; start "
                        "workers with `ray start --address HEAD:PORT --num-cpus N`")
    return nodes


def check_resources(jobs: Sequence[Job], nodes: list[dict[str, Any]]) -> None:
    """Refuse a job no node can ever hold (Ray would keep it pending forever)."""
    cpus = max(n["Resources"].get("CPU", 0) for n in nodes)
    memory = max(n["Resources"].get("memory", 0) for n in nodes)
    for job in jobs:
        if job.cpus > cpus:
            raise UserError(f"run {job.name} asks for {job.cpus:g} CPUs but the largest "
                            f"node has {cpus:g}; lower --cpus-per-run or add a bigger node")
        if job.memory_bytes > memory:
            raise UserError(f"run {job.name} needs at least {job.memory_bytes / 2**30:.1f} "
                            f"GiB but the largest node offers {memory / 2**30:.1f} GiB to "
                            "Ray; use a smaller config or a bigger node")


def check_shared_paths(ray, jobs: Sequence[Job], nodes: list[dict[str, Any]],
                       timeout_s: float) -> None:
    """Every node must see the run directories (a shared filesystem): a file written here
    is looked for on each node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    roots = sorted({str(Path(j.cwd, j.run_dir).parent) for j in jobs if j.run_dir})
    if not roots:
        return
    token = uuid.uuid4().hex
    markers = []
    for root in roots:
        Path(root).mkdir(parents=True, exist_ok=True)
        marker = Path(root) / f".moelab-probe-{token}"
        marker.write_text(token)
        markers.append(str(marker))
    probe = ray.remote(_probe)
    try:
        refs = {n["NodeManagerAddress"] + " " + n["NodeID"][:8]: probe.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], False)
        ).remote(markers, token) for n in nodes}
        try:
            answers = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s),
                               strict=True))
        except ray.exceptions.GetTimeoutError:
            raise UserError(f"a Ray node did not answer within {timeout_s:.0f} s when asked "
                            "whether it sees the run directories; is the cluster busy or "
                            "a node hung?") from None
    finally:
        for marker in markers:
            Path(marker).unlink(missing_ok=True)
    for node, missing in answers.items():
        if missing:
            raise UserError(f"node {node} does not see {Path(missing).parent}: run "
                            "directories must be on a path every node mounts (NFS, a "
                            "FUSE-mounted bucket); pass --out on such a path")


def _probe(markers: list[str], token: str) -> str:
    for marker in markers:
        try:
            if Path(marker).read_text() == token:
                continue
        except OSError:
            pass
        return marker
    return ""


def _attempt_on_node(job: Job, *deps: Any) -> Any:
    import ray

    ctx = ray.get_runtime_context()
    node = f"{ray.util.get_node_ip_address()} {ctx.get_node_id()[:8]}"
    return run_attempt(job, *deps, node=node, log=True)


# ----------------------------------------------------------------- waiting


def wait_all(ray, jobs: Sequence[Job], refs: dict[str, Any], stall_timeout_s: float,
             poll_s: float) -> dict[str, Any]:
    """Collect every result, printing the progress table whenever a run changes state."""
    from ray.exceptions import RayTaskError

    names = {ref: name for name, ref in refs.items()}
    results: dict[str, Any] = {}
    table = Progress(jobs)
    last_change = last_shown = time.monotonic()
    while len(results) < len(jobs):
        pending = [ref for ref, name in names.items() if name not in results]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for ref in ready:
            name = names[ref]
            try:
                results[name] = ray.get(ref)
            except RayTaskError as err:
                _cancel(ray, names, results)
                cause = err.cause if isinstance(err.cause, Exception) else None
                if cause is not None and not isinstance(cause, RayTaskError):
                    table.show(results, failed=name)
                    raise cause from None
                raise UserError(f"run {name} failed: {_last_line(err)}") from None
            except ray.exceptions.RayError as err:  # retries used up: workers kept dying
                _cancel(ray, names, results)
                table.show(results, failed=name)
                raise UserError(f"run {name} was lost {table.attempts(name)} times "
                                f"({type(err).__name__}); giving up") from None
        moved, progressed = table.update(results)
        now = time.monotonic()
        if progressed:
            last_change = now
        if moved or now - last_shown > SHOW_EVERY_S:
            table.show(results)
            last_shown = now
        elif now - last_change > stall_timeout_s:
            _cancel(ray, names, results)
            raise UserError(f"no run changed state or step for {stall_timeout_s:.0f} s; "
                            "stopping (is the cluster out of free CPUs or memory?)")
    table.show(results)
    return results


def _cancel(ray, names: dict[Any, str], results: dict[str, Any]) -> None:
    """Force-cancel the runs still going. A run that has already finished (its result
    ready, not yet collected) is left alone: force-cancelling a task whose reply was in
    flight crashed Ray 2.60.0's driver once in CI (a failed check in task_manager.cc's
    CompletePendingTask), and the ladder exited 1 instead of with the run's own error."""
    pending = [ref for ref, name in names.items() if name not in results]
    if not pending:
        return
    _, running = ray.wait(pending, num_returns=len(pending), timeout=0)
    for ref in running:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 (finished or gone meanwhile: nothing to cancel)
            pass


def _last_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:500]


class Progress:
    """The table: each run pending / running on a node / done, with attempts and step."""

    def __init__(self, jobs: Sequence[Job]):
        self.jobs = list(jobs)
        self.state: dict[str, tuple] = {}

    def attempts(self, name: str) -> int:
        job = next(j for j in self.jobs if j.name == name)
        return len(attempts(Path(job.cwd, job.run_dir))) if job.run_dir else 0

    def _row(self, job: Job, results: dict[str, Any]) -> tuple:
        tries = attempts(Path(job.cwd, job.run_dir)) if job.run_dir else []
        step = _last_step(Path(job.cwd, job.run_dir)) if job.run_dir else 0
        if job.name in results:
            state = "done"
        elif tries:
            state = "running"
        else:
            state = "pending"
        last = tries[-1] if tries else {}
        return (state, last.get("node", ""), len(tries), step, last.get("resumes_at", 0),
                last.get("lost_steps", 0))

    def update(self, results: dict[str, Any]) -> tuple[bool, bool]:
        """Refresh; (a run changed state, node or attempt; a run changed at all)."""
        now = {job.name: self._row(job, results) for job in self.jobs}
        moved = {k: v[:3] for k, v in now.items()} != {k: v[:3] for k, v in self.state.items()}
        progressed, self.state = now != self.state, now
        return moved, progressed

    def show(self, results: dict[str, Any], failed: str | None = None) -> None:
        self.update(results)
        width = max(len(j.name) for j in self.jobs)
        lines = [f"[ray] {'run':<{width}}  {'state':<8} {'node':<26} tries  step"]
        for job in self.jobs:
            state, node, tries, step, resumes, lost = self.state[job.name]
            if job.name == failed:
                state = "failed"
            note = (f"  retried {tries - 1}x: resumed at step {resumes}, lost {lost} steps"
                    if tries > 1 else "")
            lines.append(f"[ray] {job.name:<{width}}  {state:<8} {node:<26} {tries:>5}  "
                         f"{step}{note}")
        print("\n".join(lines), flush=True)


def _last_step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl, read from its tail (the file grows per step)."""
    from moelab.train.rundir import METRICS_FILE

    path = run_dir / METRICS_FILE
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(file.tell() - 8192, 0))
            tail = file.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0
