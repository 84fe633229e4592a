"""The lab's metrics store: one SQLite file holding experiments, runs, metrics, events and
pre-registered predictions.

SQLite because a lab should be a file you can copy, diff and open without a server. Every
write is one transaction (BEGIN IMMEDIATE ... COMMIT) in WAL mode, so a trainer killed
mid-step loses at most that step, and the dashboard can read while the trainer writes.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from moelab.errors import UserError
from moelab.lab.mirror import start_mirror
from moelab.lab.records import (
    ENDED,
    RUN_ENDED,
    Event,
    Experiment,
    Prediction,
    Run,
    check_scoring,
    check_transition,
)
from moelab.outputs import check_file
from moelab.schema import SchemaError, check, read_json

SCHEMA_VERSION = 1

# Column names match the fields of the records dataclasses, so rows map onto them directly.
SCHEMA = f"""
PRAGMA journal_mode = WAL;
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS experiments (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, hypothesis TEXT NOT NULL, config TEXT NOT NULL,
    git_commit TEXT, status TEXT NOT NULL, outcome TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL, finished_at REAL);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, experiment_id TEXT NOT NULL REFERENCES experiments(id),
    run_dir TEXT NOT NULL, config TEXT NOT NULL, status TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '', started_at REAL NOT NULL, finished_at REAL);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL REFERENCES runs(id), name TEXT NOT NULL, step INTEGER NOT NULL,
    value REAL,  -- NULL means NaN (SQLite cannot store NaN), and a NaN loss is data
    UNIQUE (run_id, name, step));
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL REFERENCES runs(id), step INTEGER NOT NULL, kind TEXT NOT NULL,
    message TEXT NOT NULL, created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, step);
CREATE TABLE IF NOT EXISTS predictions (
    id INTEGER PRIMARY KEY, experiment_id TEXT NOT NULL REFERENCES experiments(id),
    name TEXT NOT NULL, value REAL NOT NULL, low REAL NOT NULL, high REAL NOT NULL,
    details TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TRIGGER IF NOT EXISTS predictions_no_update BEFORE UPDATE ON predictions
BEGIN SELECT RAISE(ABORT, 'predictions are pre-registered and cannot be changed'); END;
CREATE TRIGGER IF NOT EXISTS predictions_no_delete BEFORE DELETE ON predictions
BEGIN SELECT RAISE(ABORT, 'predictions are pre-registered and cannot be deleted'); END;
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""


def default_lab_path() -> Path:
    """The lab file: env MOELAB_LAB if set, else runs/lab.sqlite under the working directory."""
    return Path(os.environ.get("MOELAB_LAB") or "runs/lab.sqlite")


class Store:
    """Read and write one lab file.

    mode is SQLite's own: "rwc" creates the file if missing (commands that record), "rw"
    and "ro" require it to exist (commands that only look; the dashboard uses "ro").
    """

    def __init__(self, path: str | Path, mode: Literal["rwc", "rw", "ro"] = "rwc") -> None:
        self.path = Path(path)
        if mode != "rwc" and not self.path.is_file():
            raise UserError(f"no lab database at {self.path}; create one with `moelab lab new`")
        if mode == "rwc":  # a directory, or a path under a file: one line, not sqlite's error
            check_file(self.path, "lab file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"{self.path.absolute().as_uri()}?mode={mode}"
        # isolation_level=None: transactions are exactly the ones _write opens.
        self._db = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._mirrors: dict[str, Any] = {}  # run id -> wandb run, for runs started here
        try:
            self._prepare(mode)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as err:  # text bytes damaged too
            self._db.close()
            raise UserError(
                f"{self.path} is not a readable moelab lab database ({err}); move it aside "
                "to start a new lab, or restore it from a backup"
            ) from err

    def _prepare(self, mode: str) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0 and mode != "ro" and not self._db.execute(
            "SELECT 1 FROM sqlite_master"
        ).fetchone():
            self._db.executescript(SCHEMA)
        elif version != SCHEMA_VERSION:
            raise UserError(
                f"{self.path} is not a moelab lab database (schema version {version}, "
                f"expected {SCHEMA_VERSION}); point --lab or MOELAB_LAB at a lab file"
            )
        self._db.execute("PRAGMA foreign_keys = ON")
        # FULL: a commit is on disk before log_metrics returns, so even a power cut loses
        # at most the step being written.
        self._db.execute("PRAGMA synchronous = FULL")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction. IMMEDIATE takes the write lock up front, so reading an id and
        then inserting it cannot race another writer."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ------------------------------------------------------------------ experiments

    def new_experiment(
        self, name: str, hypothesis: str, config: dict[str, Any], git_commit: str | None
    ) -> str:
        """Record a planned experiment and return its id ("exp-<n>")."""
        _require_text("name", name)
        _require_text("hypothesis", hypothesis)
        with self._write() as db:
            exp_id = _next_id(db, "experiments", "exp")
            db.execute(
                "INSERT INTO experiments (id, name, hypothesis, config, git_commit, status,"
                " created_at) VALUES (?, ?, ?, ?, ?, 'planned', ?)",
                (exp_id, name, hypothesis, _json(config), git_commit, time.time()),
            )
        return exp_id

    def get_experiment(self, exp_id: str) -> Experiment:
        row = self._db.execute("SELECT * FROM experiments WHERE id = ?", (exp_id,)).fetchone()
        if row is None:
            raise UserError(f"no experiment {exp_id!r} in {self.path}; `moelab lab list` shows ids")
        return _record(Experiment, row)

    def list_experiments(self) -> list[Experiment]:
        rows = self._db.execute("SELECT * FROM experiments ORDER BY created_at, rowid")
        return [_record(Experiment, row) for row in rows]

    def finish_experiment(self, exp_id: str, status: str, outcome: str) -> None:
        """End an experiment; the outcome says what happened, failures included."""
        if status not in ENDED:
            raise UserError(f"status {status!r}: an experiment ends as one of {', '.join(ENDED)}")
        _require_text("outcome", outcome)
        with self._write() as db:
            check_transition(self.get_experiment(exp_id), status)
            db.execute(
                "UPDATE experiments SET status = ?, outcome = ?, finished_at = ? WHERE id = ?",
                (status, outcome, time.time(), exp_id),
            )

    # ------------------------------------------------------------------------- runs

    def start_run(self, exp_id: str, run_dir: str, config: dict[str, Any],
                  fork: tuple[str, int] | None = None,
                  claim: Callable[[str], None] | None = None) -> str:
        """Attach a new run to an experiment (which becomes running) and return its id.
        `fork`: (parent run id, step) when the run branches from another (W&B fork_from).
        `claim(run_id)`: called inside the transaction (the run dir's record of its lab
        run, say); if it raises, no run is recorded."""
        with self._write() as db:
            experiment = self.get_experiment(exp_id)
            check_transition(experiment, "running")
            run_id = _next_id(db, "runs", "run")
            db.execute(
                "INSERT INTO runs (id, experiment_id, run_dir, config, status, started_at)"
                " VALUES (?, ?, ?, ?, 'running', ?)",
                (run_id, exp_id, str(run_dir), _json(config), time.time()),
            )
            db.execute("UPDATE experiments SET status = 'running' WHERE id = ?", (exp_id,))
            if claim is not None:
                claim(run_id)
            # Inside the transaction: a mirror that cannot start leaves no run behind.
            if (mirror := start_mirror(run_id, experiment, config, self.path, fork)) is not None:
                self._mirrors[run_id] = mirror
        return run_id

    def get_run(self, run_id: str) -> Run:
        row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise UserError(f"no run {run_id!r} in {self.path}")
        return _record(Run, row)

    def attached_run(self, marker: Path) -> str:
        """The lab run a run dir's lab_run.json (`marker`) names, which this lab must hold:
        a run attached to another lab would fail each write on its foreign key."""
        run_id = read_json(marker, {"run_id": str})["run_id"]
        if self._db.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
            raise UserError(f"{marker} names lab run {run_id!r}, which {self.path} does not "
                            "hold: the run was attached to another lab; point --lab or "
                            "MOELAB_LAB at that lab")
        return run_id

    def runs(self, exp_id: str) -> list[Run]:
        rows = self._db.execute(
            "SELECT * FROM runs WHERE experiment_id = ? ORDER BY started_at, rowid", (exp_id,)
        )
        return [_record(Run, row) for row in rows]

    def finish_run(self, run_id: str, status: str, message: str = "") -> None:
        if status not in RUN_ENDED:
            raise UserError(f"status {status!r}: a run ends as one of {', '.join(RUN_ENDED)}")
        with self._write() as db:
            run = self.get_run(run_id)
            if run.status != "running":
                raise UserError(f"run {run_id} already ended as {run.status}")
            db.execute(
                "UPDATE runs SET status = ?, message = ?, finished_at = ? WHERE id = ?",
                (status, message, time.time(), run_id),
            )
        if (mirror := self._mirrors.pop(run_id, None)) is not None:
            mirror.finish(exit_code=0 if status == "succeeded" else 1)

    # ------------------------------------------------------------ metrics and events

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        """Write one step's metrics, all or none. Re-logging a step (after a resume from an
        earlier checkpoint) replaces the old values."""
        rows = ((run_id, name, int(step), _number(name, v)) for name, v in metrics.items())
        with self._write() as db:
            db.executemany(
                "INSERT OR REPLACE INTO metrics (run_id, name, step, value) VALUES (?, ?, ?, ?)",
                rows,
            )
        if (mirror := self._mirrors.get(run_id)) is not None:
            mirror.log(dict(metrics), step=int(step))

    def log_event(self, run_id: str, step: int, kind: str, message: str) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO events (run_id, step, kind, message, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (run_id, int(step), kind, message, time.time()),
            )
        if (mirror := self._mirrors.get(run_id)) is not None:
            mirror.log({f"event/{kind}": 1.0}, step=int(step))

    def import_history(self, run_id: str, metrics: list[dict], events: list[dict]) -> None:
        """Copy a run's record so far (its metrics.jsonl and events.jsonl records) into the
        store in one transaction: a run attached after it trained shows its curves, last
        step and events like one attached from the start. Non-numeric fields are skipped."""
        rows = [(run_id, name, int(record["step"]), _number(name, value))
                for record in metrics for name, value in record.items()
                if name != "step" and isinstance(value, int | float)]
        with self._write() as db:
            db.executemany("INSERT OR REPLACE INTO metrics (run_id, name, step, value)"
                           " VALUES (?, ?, ?, ?)", rows)
            db.executemany("INSERT INTO events (run_id, step, kind, message, created_at)"
                           " VALUES (?, ?, ?, ?, ?)",
                           [(run_id, int(e["step"]), str(e["kind"]), str(e["message"]),
                             time.time()) for e in events])

    def metrics(self, run_id: str, name: str) -> list[tuple[int, float]]:
        """(step, value) pairs in step order; NaN where the value was NaN."""
        rows = self._db.execute(
            "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? ORDER BY step",
            (run_id, name),
        )
        return [(step, math.nan if value is None else value) for step, value in rows]

    def all_metrics(self, run_id: str) -> dict[str, list[tuple[int, float]]]:
        """Every metric of a run as {name: (step, value) pairs in step order}, in one query:
        what an interactive chart page embeds."""
        rows = self._db.execute(
            "SELECT name, step, value FROM metrics WHERE run_id = ? ORDER BY name, step",
            (run_id,),
        )
        series: dict[str, list[tuple[int, float]]] = {}
        for name, step, value in rows:
            series.setdefault(name, []).append((step, math.nan if value is None else value))
        return series

    def latest(self, run_id: str) -> dict[str, tuple[int, float]]:
        """Each metric's last (step, value): what a summary shows and the dashboard polls."""
        rows = self._db.execute(
            "SELECT name, MAX(step), value FROM metrics WHERE run_id = ? GROUP BY name",
            (run_id,),
        )
        return {name: (step, math.nan if value is None else value) for name, step, value in rows}

    def events(self, run_id: str) -> list[Event]:
        rows = self._db.execute(
            "SELECT * FROM events WHERE run_id = ? ORDER BY step, rowid", (run_id,)
        )
        return [_record(Event, row) for row in rows]

    # ------------------------------------------------------------------ predictions

    def add_prediction(
        self,
        exp_id: str,
        name: str,
        value: float,
        low: float,
        high: float,
        details: dict[str, Any],
    ) -> int:
        """Pre-register a prediction. There is no update API, and a trigger refuses UPDATE
        and DELETE, so what was predicted is what the report shows. details may name the
        run it is scored on ("run") or the rule over the experiment's runs ("rule")."""
        _require_text("name", name)
        if not all(map(math.isfinite, (value, low, high))) or not low <= value <= high:
            raise UserError(f"prediction {name!r}: need finite low <= value <= high, got "
                            f"{low} <= {value} <= {high}")
        check_scoring(details)
        with self._write() as db:
            experiment = self.get_experiment(exp_id)
            if experiment.status in ENDED:
                raise UserError(f"experiment {exp_id} has ended ({experiment.status}); "
                                "a prediction must be registered before the outcome is known")
            cursor = db.execute(
                "INSERT INTO predictions (experiment_id, name, value, low, high, details,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (exp_id, name, value, low, high, _json(details), time.time()),
            )
        return int(cursor.lastrowid)

    def predictions(self, exp_id: str) -> list[Prediction]:
        rows = self._db.execute(
            "SELECT * FROM predictions WHERE experiment_id = ? ORDER BY id", (exp_id,)
        )
        return [_record(Prediction, row) for row in rows]


def _next_id(db: sqlite3.Connection, table: str, prefix: str) -> str:
    """Short readable ids ("exp-3"); safe because rows are never deleted and the caller
    holds the write lock."""
    (count,) = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    return f"{prefix}-{count + 1}"


def _record(cls: type, row: sqlite3.Row) -> Any:
    """A record from its row; its JSON columns must hold mappings (a hand-edited database
    is refused in one line, not a traceback wherever the value is used)."""
    values = dict(row)
    for key in ("config", "details"):
        if key in values:
            where = f"{cls.__name__.lower()} {values.get('id', '?')}: {key}"
            try:
                values[key] = check(json.loads(values[key]), dict, "the lab database", where)
            except (ValueError, TypeError):
                raise SchemaError("the lab database", f"{where} is not JSON") from None
    return cls(**values)


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _require_text(field: str, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{field} is required and must not be empty")


def _number(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise UserError(f"metric {name!r}: {value!r} is not a number") from err
