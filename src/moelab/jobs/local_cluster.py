"""A throwaway multi-node Ray cluster on this machine: `ray start --head` plus worker nodes,
each its own set of processes, all under a private temp dir so they can be found, one
node killed, and all stopped without touching any other Ray on the machine. For the
fault-tolerance tests and the scaling bench; a real cluster is started the same way, one
`ray start` per machine (README: "When you outgrow one machine").
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

# A killed node is declared dead after health_check_failure_threshold missed checks,
# health_check_period_ms apart: ~3 s here instead of Ray's default ~30 s.
FAST_FAILURE = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                "RAY_health_check_timeout_ms": "1000"}
# Ray 2.60 turns token authentication on for a head started while ~/.ray/auth_token exists
# (another Ray run may have written it), and a node or driver that does not read it the
# same way is refused: a throwaway loopback cluster states its mode for every process.
DRIVER_ENV = {"RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalCluster:
    """`ray start --head` (no CPUs: it only schedules) and `workers` worker nodes."""

    def __init__(self, workers: int = 2, cpus_per_worker: int = 1):
        self.temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: socket paths
        self.address = f"127.0.0.1:{free_port()}"
        src = str(Path(__file__).resolve().parents[2])  # this moelab, for the workers
        self.env = {**os.environ, **FAST_FAILURE, **DRIVER_ENV,
                    "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]
        self._ray("start", "--head", f"--port={self.address.split(':')[1]}", "--num-cpus=0",
                  "--include-dashboard=false", f"--temp-dir={self.temp}", *common)
        for _ in range(workers):
            self._ray("start", f"--address={self.address}", f"--num-cpus={cpus_per_worker}",
                      *common)

    def _ray(self, *args: str) -> None:
        subprocess.run([shutil.which("ray") or "ray", *args], env=self.env, check=True,
                       capture_output=True, timeout=120)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every process of this cluster."""
        found = {}
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if str(self.temp) in cmd:
                    found[int(proc.name)] = cmd
        return found

    def kill_node_of(self, pid: int) -> list[int]:
        """SIGKILL the raylet that started worker `pid` and every process of that node."""
        raylet = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmd = self.processes()[raylet]
        socket_name = next(a for a in cmd.split() if a.startswith("--raylet_socket_name="))
        sock = socket_name.split("=", 1)[1]
        victims = [p for p, c in self.processes().items()
                   if p == raylet or sock + " " in c + " " or p == pid]
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return victims

    def stop(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)



    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
