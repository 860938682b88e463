"""The scheduler's state in SQLite: the cluster, every job, and every transition it made.

[Note: scheduler state] One database, ``<state>/sched.db``, is the only channel between the CLI
commands and the serve loop: ``submit`` inserts a job, ``cancel`` marks one, ``status`` reads,
and ``serve`` polls it and acts. There is no socket, so there is nothing to listen, no peer to
authenticate and no message format to parse: who may touch the scheduler is decided by the
file system, as for a user's own checkpoints (the state directory is created mode 0700, the
database 0600). SQLite serialises writers (``BEGIN IMMEDIATE``), so a transition is read,
checked with `jobs.advance` and written in one transaction: a ``cancel`` racing the serve loop's
start of the same job makes one of them fail cleanly instead of both acting.

A state change goes only through `Store.transition`, which calls `jobs.advance` and appends the
change to the ``events`` table (the job's history, shown by ``status --json``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobState, advance

__all__ = ["DB_NAME", "JobRecord", "Store", "job_dir"]

DB_NAME = "sched.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    devices INTEGER NOT NULL,
    device TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    workdir TEXT NOT NULL,
    devices INTEGER NOT NULL,
    min_devices INTEGER NOT NULL,
    max_devices INTEGER NOT NULL DEFAULT 0,
    speedup TEXT NOT NULL DEFAULT '{}',
    steps INTEGER NOT NULL,
    checkpoint_every INTEGER NOT NULL,
    state TEXT NOT NULL,
    submitted REAL NOT NULL,
    attained REAL NOT NULL DEFAULT 0,
    executed REAL NOT NULL DEFAULT 0,
    last_stopped REAL,
    allocated INTEGER NOT NULL DEFAULT 0,
    last_allocated INTEGER NOT NULL DEFAULT 0,
    placed TEXT NOT NULL DEFAULT '[]',
    started REAL,
    first_started REAL,
    starts INTEGER NOT NULL DEFAULT 0,
    preempt_at REAL,
    preempt_step INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    message TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    old TEXT,
    new TEXT NOT NULL,
    note TEXT NOT NULL DEFAULT ''
);
"""


@dataclass(frozen=True)
class JobRecord:
    """One row of ``jobs``: what was submitted and where the job stands."""

    id: str
    config: str  # the stored job file (absolute path)
    workdir: str  # the submitter's working directory: relative paths in the job mean this
    devices: int  # asked for (the most it runs on)
    min_devices: int
    steps: int  # train.steps, for the progress estimate
    checkpoint_every: int
    state: JobState
    submitted: float
    max_devices: int = 0  # the most an elastic policy may give it (0: devices)
    speedup: dict[int, float] = field(default_factory=dict)  # planner's, per device count
    attained: float = 0.0  # device-seconds of service in finished runs
    executed: float = 0.0  # seconds it held devices in finished runs
    last_stopped: float | None = None  # when it last lost its devices
    allocated: int = 0  # devices held now (running or preempting)
    last_allocated: int = 0  # devices of the latest run (its logged step time was on these)
    placed: tuple[int, ...] = ()  # their indices
    started: float | None = None  # when the current run started
    first_started: float | None = None
    starts: int = 0  # runs launched so far; run n writes start-<n>/
    preempt_at: float | None = None  # when a preemption was requested
    preempt_step: int | None = None  # the newest checkpoint's step at that moment (-1: none)
    cancel_requested: bool = False
    exit_code: int | None = None
    message: str = ""


_COLUMNS = [f.name for f in fields(JobRecord)]
_MUTABLE = set(_COLUMNS) - {"id", "config", "workdir", "state", "submitted"}


def _encode(name: str, value: Any) -> Any:
    if name == "placed":
        return json.dumps(list(value))
    if name == "speedup":
        return json.dumps({str(k): v for k, v in value.items()})
    if name == "state":
        return str(value)
    if name == "cancel_requested":
        return int(value)
    return value


def _record(row: sqlite3.Row) -> JobRecord:
    values = dict(zip(row.keys(), row, strict=True))
    values["state"] = JobState(values["state"])
    values["placed"] = tuple(json.loads(values["placed"]))
    values["speedup"] = {int(k): float(v) for k, v in json.loads(values["speedup"]).items()}
    values["cancel_requested"] = bool(values["cancel_requested"])
    return JobRecord(**values)


def job_dir(state_dir: Path, job_id: str) -> Path:
    """``<state>/jobs/<id>``: the stored job file, its checkpoints, and one folder per run."""
    return state_dir / "jobs" / job_id


class Store:
    """The database of one state directory; see [Note: scheduler state]."""

    def __init__(self, state_dir: str | os.PathLike[str], *, create: bool = False) -> None:
        self.dir = Path(state_dir).absolute()
        path = self.dir / DB_NAME
        if not path.exists():
            if not create:
                raise ConfigError(
                    f"--state {str(self.dir)!r} holds no scheduler state: start "
                    f"`polytrain sched serve --state {self.dir} --devices N` first"
                )
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.dir, 0o700)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction that holds the write lock from its first read."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- the cluster -------------------------------------------------------------------------

    def set_cluster(self, devices: int, device: str) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO cluster (id, devices, device) VALUES (1, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET devices = excluded.devices, device = excluded.device",
                (devices, device),
            )

    def cluster(self) -> tuple[int, str]:
        """(device slots, device kind) as the serve command last set them."""
        row = self._db.execute("SELECT devices, device FROM cluster").fetchone()
        if row is None:
            raise ConfigError(
                f"--state {str(self.dir)!r} has no cluster yet: start `polytrain sched serve "
                f"--state {self.dir} --devices N` first"
            )
        return int(row["devices"]), str(row["device"])

    # -- jobs --------------------------------------------------------------------------------

    def add(self, job: JobRecord) -> None:
        """Queue ``job``; a ConfigError if its id is taken (the queue is left as it was)."""
        assert job.state == JobState.QUEUED
        with self._write() as db:
            if db.execute("SELECT 1 FROM jobs WHERE id = ?", (job.id,)).fetchone():
                raise ConfigError(
                    f"job id {job.id!r} is already in the queue: choose another --name"
                )
            names = ", ".join(_COLUMNS)
            marks = ", ".join("?" for _ in _COLUMNS)
            db.execute(
                f"INSERT INTO jobs ({names}) VALUES ({marks})",
                [_encode(n, getattr(job, n)) for n in _COLUMNS],
            )
            self._event(db, job.id, None, job.state, "submitted", job.submitted)

    def has(self, job_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is not None

    def get(self, job_id: str) -> JobRecord:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise ConfigError(
                f"no job {job_id!r} in {str(self.dir)!r}: see `polytrain sched status`"
            )
        return _record(row)

    def jobs(self) -> list[JobRecord]:
        """Every job, oldest submission first."""
        rows = self._db.execute("SELECT * FROM jobs ORDER BY submitted, id").fetchall()
        return [_record(row) for row in rows]

    def transition(
        self,
        job_id: str,
        new: JobState,
        *,
        expect: Sequence[JobState] | None = None,
        note: str = "",
        now: float | None = None,
        **changes: Any,
    ) -> JobRecord:
        """Move ``job_id`` to ``new`` (legal only by `jobs.advance`) and set ``changes`` with it.

        ``expect``: the states the caller saw; a ConfigError if another process moved the job
        meanwhile (a cancel racing a start), so the caller does not act on a stale view."""
        with self._write() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise ConfigError(f"no job {job_id!r} in {str(self.dir)!r}")
            old = JobState(row["state"])
            if expect is not None and old not in expect:
                raise ConfigError(f"job {job_id!r} is {old} now, not {'/'.join(map(str, expect))}")
            advance(job_id, old, new)
            self._set(db, job_id, {"state": new, **changes})
            self._event(db, job_id, old, new, note, time.time() if now is None else now)
        return self.get(job_id)

    def update(self, job_id: str, **changes: Any) -> JobRecord:
        """Set fields other than the state (progress, cancel request)."""
        assert "state" not in changes, "states change only through transition()"
        with self._write() as db:
            self._set(db, job_id, changes)
        return self.get(job_id)

    def events(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT time, old, new, note FROM events WHERE job_id = ? ORDER BY seq", (job_id,)
        ).fetchall()
        return [dict(zip(row.keys(), row, strict=True)) for row in rows]

    def _set(self, db: sqlite3.Connection, job_id: str, changes: dict[str, Any]) -> None:
        unknown = set(changes) - _MUTABLE - {"state"}
        assert not unknown, f"not a mutable job field: {sorted(unknown)}"
        if not changes:
            return
        assign = ", ".join(f"{name} = ?" for name in changes)
        values = [_encode(n, v) for n, v in changes.items()]
        db.execute(f"UPDATE jobs SET {assign} WHERE id = ?", [*values, job_id])

    @staticmethod
    def _event(
        db: sqlite3.Connection,
        job_id: str,
        old: JobState | None,
        new: JobState,
        note: str,
        when: float,
    ) -> None:
        db.execute(
            "INSERT INTO events (job_id, time, old, new, note) VALUES (?, ?, ?, ?, ?)",
            (job_id, when, None if old is None else str(old), str(new), note),
        )
