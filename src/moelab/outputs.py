"""The one check every writer runs on its output path before it computes anything, and the
marker that says a directory is moelab's own.

A command that writes into a directory must never delete or overwrite what it did not
create. So each writer calls `check_dir` (or `check_file` for a single output file) first:
a path that is a file, lies under a file, cannot be written, or is a non-empty directory
that moelab did not make is refused in one line (a UserError: exit 2), before anything is
written. A directory moelab makes carries `MARKER`; `--force` replaces only such a
directory, never one without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from moelab.errors import UserError

MARKER = ".moelab-output"  # a directory holding this file was made by moelab


def _existing_ancestor(path: Path, flag: str) -> Path:
    """The nearest existing ancestor of path, which must be a writable directory."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path} is under {parent}, which is a file, not a directory; "
                        "choose another path")
    if not writable(parent):
        raise UserError(f"{flag} {path}: {parent} is not writable; choose another path")
    return parent


def writable(path: Path) -> bool:
    """Whether this process may create files in the directory `path` (os.access: root may
    write where the mode bits say no, so a mode check alone would refuse root wrongly)."""
    return os.access(path, os.W_OK | os.X_OK)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_ours(path: Path, made_by: tuple[str, ...] | None = None) -> bool:
    """Whether moelab made the directory `path`; with `made_by`, one of those commands
    (an export is not an eval's output directory, nor a ladder's)."""
    if not (path / MARKER).is_file():
        return False
    return made_by is None or marker(path).get("made_by") in {f"moelab {c}" for c in made_by}


def check_file(path: Path, flag: str = "--out", ours: bool = True) -> None:
    """A single output file: not a directory, not under a file, its directory writable;
    an existing one only if `ours` (the caller recognised it as its own earlier output)."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; pass a file path")
    if path.exists() and not ours:
        raise UserError(f"{flag} {path} exists and is not an earlier output of this "
                        "command; choose a new path (nothing is overwritten)")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UserError(f"{flag} {path} is not writable; choose another path")
        return
    _existing_ancestor(path, flag)


def check_dir(path: Path, force: bool = False, flag: str = "--out",
              ours: bool | None = None, made_by: tuple[str, ...] | None = None) -> bool:
    """Refuse an output directory moelab must not write into; True when it exists with
    content that the caller may replace (`force` and moelab's marker, from one of the
    commands `made_by` when given, or `ours`: the caller's own outputs recognised another
    way, e.g. a run directory's `eval/`)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory; pass a directory")
    if not path.exists():
        _existing_ancestor(path, flag)
        return False
    if not writable(path):
        raise UserError(f"{flag} {path} is not writable; choose another directory")
    if not any(path.iterdir()):
        return False
    mine = is_ours(path, made_by) if ours is None else ours
    if not mine and is_ours(path):  # moelab's, but another command's output
        made = marker(path).get("made_by") or "another moelab command"
        this = f"moelab {' / '.join(made_by)}" if made_by else "this command"
        raise UserError(f"{flag} {path} holds what {made} wrote, not an earlier output of "
                        f"{this}; choose an empty or new directory (nothing is overwritten)")
    if not mine:
        raise UserError(f"{flag} {path} is not empty and moelab did not make it (no {MARKER} "
                        "in it); choose an empty or new directory"
                        + (" (--force replaces only directories moelab made)" if force else ""))
    return True


def mark(path: Path, command: str, **record: object) -> None:
    """Record that `command` made the directory `path` (created if missing), with what else
    the writer wants to find again (an export's file hashes)."""
    path.mkdir(parents=True, exist_ok=True)
    if not is_ours(path):
        (path / MARKER).write_text(json.dumps({"made_by": f"moelab {command}", **record}) + "\n")


def marker(path: Path) -> dict:
    """The record `mark` wrote in `path` ({} where there is none or it is unreadable)."""
    try:
        record = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def remove_ours(path: Path) -> None:
    """Delete a directory moelab made; anything else is refused, never deleted."""
    if not is_ours(path):
        raise UserError(f"{path} was not made by moelab (no {MARKER} in it); not removing it")
    shutil.rmtree(path)
