"""The run directory's contract: its file names, its lock, and its config as identity.

A run directory holds one run. Its files, each named only here:

    config.yaml            the config of the first start: the run's identity
    config.step-N.yaml     a config accepted with --allow-config-change at step N
    metrics.jsonl          one JSON line per step (rewound to the checkpoint on resume)
    events.jsonl           resume, restart, spike, nan, interrupted, config_change, ...
    checkpoints/N/         orbax checkpoint of step N, with its integrity record
    checkpoints.bad/       checkpoints that failed verification, moved aside, never deleted
    train.lock             advisory lock held by the one trainer writing here (its pid)
    worker.pid             pid of the supervisor's current worker
    lab_run.json           the lab run id this directory reports to
    lineage.json           a branch's parent: its run dir, step, lab run, optimizer state
    history-STAMP/         an earlier run's files, archived by --restart-from-scratch
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from pathlib import Path
from typing import Any

from moelab.config import Config, config_to_dict, dump_config
from moelab.errors import ConfigError, UserError
from moelab.schema import brief, read_yaml

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
CHECKPOINT_DIR = "checkpoints"
QUARANTINE_DIR = "checkpoints.bad"
LOCK_FILE = "train.lock"
WORKER_PID_FILE = "worker.pid"
LAB_RUN_FILE = "lab_run.json"
LINEAGE_FILE = "lineage.json"
RUN_ID_FILE = "run_id.json"  # the run's id, which its checkpoints record (train/identity.py)

_CHANGED_CONFIG = re.compile(r"config\.step-(\d+)\.yaml")


class RunDirLock:
    """An exclusive advisory `fcntl` lock on the run directory, held while training.

    The OS releases it when the holder dies (even by SIGKILL), so a stale lock never
    blocks a restart; a second live trainer on the same directory is refused with the
    holder's pid instead of interleaving its steps with the first one's.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise UserError(f"RUN_DIR {self.path.parent} is a file, not a directory; "
                            "pass a directory path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise UserError(f"{self.path.parent} is in use by another trainer (pid {holder}); "
                            "wait for it to finish or stop it, or pass another RUN_DIR"
                            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays, harmlessly
            self._fd = None


def current_config_path(run_dir: Path) -> Path:
    """The config the run last trained with: config.yaml or the newest accepted change."""
    changes = [(int(m.group(1)), p) for p in Path(run_dir).glob("config.step-*.yaml")
               if (m := _CHANGED_CONFIG.fullmatch(p.name))]
    return max(changes)[1] if changes else Path(run_dir) / CONFIG_FILE


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "mixture":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted field: (old, new)} for every field whose value differs. A field the old
    config lacks (saved by a moelab that had no such field) is no change while the new
    value is that field's default: it computes what the old code did."""
    a, b = _flatten(old), _flatten(new)
    defaults = _flatten(config_to_dict(Config()))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            and not (k not in a and k in defaults and b.get(k) == defaults[k])}


# Where the run is placed, not what it computes: resuming onto another mesh shape (after
# losing a host, say) is allowed without --allow-config-change, and still recorded.
PLACEMENT = ("mesh.", "distributed.")


def check_identity(run_dir: Path, cfg: Config, allow_change: bool) -> dict[str, tuple]:
    """Compare `cfg` with the run's config; refuse a change unless `allow_change` (changes
    of placement only, PLACEMENT, are always accepted).

    Returns the accepted changes ({} for a fresh run or an identical config); the caller
    saves them with `save_config` once the start has passed every other check and it
    knows the step they take effect at. Writes nothing, so a refused start leaves the
    run directory as it was.
    """
    path = current_config_path(run_dir)
    if not path.exists():
        return {}
    return _compare(read_yaml(path, "run's config"), path.name, run_dir, cfg, allow_change)


def check_checkpoint_config(run_dir: Path, cfg: Config, allow_change: bool, step: int,
                            saved: dict[str, Any]) -> dict[str, tuple]:
    """The config identity check, against the config checkpoint `step` stored.

    With config.yaml deleted, the checkpoint's config is the run's identity (so deleting
    it never skips the check) and the changes it accepts are returned, as check_identity
    does. Otherwise the checkpoint's config must be one this run recorded (config.yaml or
    an accepted change, placement aside): a checkpoint copied in from another run would
    resume a state other than this run's. Returns {} then.
    """
    recorded = [read_yaml(p, "run's config") for p in sorted(Path(run_dir).glob("config*.yaml"))
                if p.name == CONFIG_FILE or _CHANGED_CONFIG.fullmatch(p.name)]
    if not recorded:
        return _compare(saved, f"checkpoint {step} (config.yaml is missing)", run_dir, cfg,
                        allow_change)
    if allow_change or any(not _refused(config_changes(r, saved)) for r in recorded
                           if isinstance(r, dict)):
        return {}
    raise ConfigError(f"checkpoint {step} in {run_dir} holds a config that this run never "
                      f"trained with ({_listed(_refused(config_changes(recorded[-1], saved)))}"
                      "): it was copied from another run; remove it (checkpoints/"
                      f"{step}), or pass --allow-config-change to resume from it anyway")


def _refused(changes: dict[str, tuple]) -> dict[str, tuple]:
    """The changes that make another run: placement may change, and `stages` is checked by
    the trainer at the resume step (only stages yet to start may change)."""
    return {k: v for k, v in changes.items() if not k.startswith(PLACEMENT) and k != "stages"}


def _listed(changes: dict[str, tuple], most: int = 20) -> str:
    listed = "; ".join(f"{k}: run {brief(a)}, now {brief(b)}"
                       for k, (a, b) in list(changes.items())[:most])
    return listed + (f" and {len(changes) - most} more" if len(changes) > most else "")


def _compare(saved: Any, where: str, run_dir: Path, cfg: Config,
             allow_change: bool) -> dict[str, tuple]:
    changes = config_changes(saved if isinstance(saved, dict) else {}, config_to_dict(cfg))
    refused = _refused(changes)
    if refused and not allow_change:
        raise ConfigError(f"the config differs from the run's {where} in {run_dir} "
                          f"(incompatible config: {_listed(refused)}); rerun with the run's "
                          "config, use a new RUN_DIR, or pass --allow-config-change to "
                          "record the change and continue")
    return changes


# What a run directory holds besides its checkpoints: the record of a run that trained.
HISTORY = (METRICS_FILE, EVENTS_FILE, LAB_RUN_FILE, CONFIG_FILE, CHECKPOINT_DIR,
           QUARANTINE_DIR, WORKER_PID_FILE, RUN_ID_FILE)
HISTORY_DIR = "history-"


def history(run_dir: Path) -> list[str]:
    """The names of the files (and checkpoint directories) of an earlier run in `run_dir`."""
    run_dir = Path(run_dir)
    found = [name for name in HISTORY if (run_dir / name).exists()]
    return found + sorted(p.name for p in run_dir.glob("config.step-*.yaml"))


def archive_history(run_dir: Path) -> Path | None:
    """Move an earlier run's files into run_dir/history-STAMP/ (never deleted, never
    appended to), so the run starts from scratch with an empty record. Call holding the
    run-dir lock. Returns the archive, or None when there was nothing to archive."""
    names = history(run_dir)
    if not names:
        return None
    archive = Path(run_dir) / f"{HISTORY_DIR}{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    archive.mkdir()
    for name in names:
        os.replace(Path(run_dir) / name, archive / name)
    return archive


def save_config(run_dir: Path, cfg: Config, step: int, changed: bool) -> Path | None:
    """Write config.yaml on the first start; after an accepted change, save the new config
    beside the old ones as the one later starts compare with. Returns the file written."""
    first = Path(run_dir) / CONFIG_FILE
    if first.exists() and not changed:
        return None
    path = Path(run_dir) / f"config.step-{step}.yaml" if first.exists() else first
    path.write_text(dump_config(cfg))
    return path
