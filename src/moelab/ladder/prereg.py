"""Pre-registration: the prediction, written once before the target trains, never edited.

The record is created with os.link from a fully written temporary file: link is atomic and
fails if the name exists, so a record is either absent or complete, and an existing one is
never overwritten (the O_EXCL guarantee without a half-written file after a crash). It is
then made read-only. Its sha256 covers every other field, so an edit is detected when a
later `ladder run` or `ladder report` reads it back.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from moelab.config import Config, config_to_dict
from moelab.errors import UserError
from moelab.schema import read_json

PREREG_FILE = "preregistration.json"
REFUSAL_FILE = "refusal.json"  # why the pre-registration refused the target (runner)
REFUSAL_KIND = "moelab.ladder.refusal/1"
REFUSAL_MD = "refusal.md"  # the same, readable
KIND = "moelab.ladder.preregistration/1"
_RUN = {"name": str, "config_sha256": str}
PREREG_SPEC = {"kind": str, "sha256": str, "rungs": [_RUN], "target": _RUN}


# Config fields added after pre-registrations were written, with their defaults: a field
# at its default is left out of the hash, so a ladder pre-registered before it still
# matches its spec (resume, report). A value other than the default is hashed.
ADDED_FIELDS = {("optim", "lr_width_power"): 1.0, ("data", "unique_sample"): "first"}


def config_sha256(config: Config) -> str:
    raw = config_to_dict(config)
    for (section, name), default in ADDED_FIELDS.items():
        if raw[section].get(name) == default:
            del raw[section][name]
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def record_sha256(record: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of every field but "sha256" itself."""
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _git_version() -> dict[str, Any]:
    """The git commit of moelab's own source tree and whether tracked files differ from it
    (then the commit alone does not reproduce the code); None outside a git checkout."""
    where = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


# Read when moelab's ladder code is imported, which is the code a process runs: a ladder
# trains its rungs for half an hour or more, and a commit made meanwhile is in the tree, not
# in the process (repetition_v10's refusal named the commit at write time, c17f406, while
# the code that decided it was its start's, dd4e0f7; the fit options it wrote show which)
_AT_IMPORT = _git_version()


def code_version() -> dict[str, Any]:
    """The commit of the code this process imported (see _AT_IMPORT). When the tree has
    moved since, `changed_since` says so, with the commit it is at now."""
    now = _git_version()
    if now == _AT_IMPORT:
        return dict(_AT_IMPORT)
    return {**_AT_IMPORT, "changed_since": {"commit": now["commit"], "dirty": now["dirty"]}}


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def write_once(path: Path, record: dict[str, Any]) -> bool:
    """Create `path` holding `record` (plus its sha256) unless it exists; True if created."""
    record = {**record, "sha256": record_sha256(record)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "x") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    path.chmod(0o444)
    return True


def read(path: Path) -> dict[str, Any]:
    """The record at `path`, checked against its own sha256."""
    try:
        record = read_json(path, PREREG_SPEC)
    except OSError as err:
        raise UserError(f"cannot read the pre-registration {path}: {err}") from err
    if record.get("kind") != KIND or record.get("sha256") != record_sha256(record):
        raise UserError(f"{path} does not match its own sha256: the pre-registration was "
                        "edited after it was written. Restore it from a backup, or start the "
                        "ladder over in a new out directory")
    return record


def check_matches(record: dict[str, Any], path: Path, runs: dict[str, str]) -> None:
    """Refuse a pre-registration made for other configs ({run name: config sha256})."""
    registered = {r["name"]: r["config_sha256"] for r in record["rungs"]}
    registered[record["target"]["name"]] = record["target"]["config_sha256"]
    changed = sorted(name for name in set(runs) | set(registered)
                     if runs.get(name) != registered.get(name))
    if changed:
        raise UserError(
            f"{path} pre-registered a prediction for other configs than this spec's (changed "
            f"or added/removed: {', '.join(changed)}); a pre-registration is never edited, so "
            "restore the spec it was made for, or run the new ladder with another --out")
