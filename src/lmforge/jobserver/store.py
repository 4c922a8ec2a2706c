"""The job server's state in one SQLite file (<workspace>/server.db): tokens and jobs.

WAL journal so that readers (the API's many GETs) never wait for the writer; one connection per
`Store`, guarded by a lock, so the server is the one writer (the `lmforge jobs token` CLI writes
from its own process, which SQLite serialises with a busy timeout). Every status change is a row
update; nothing lives only in memory, so a restarted server finds every job where it was.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DB_NAME = "server.db"
LOCK_NAME = "server.lock"  # held by the one server that runs this workspace's jobs (jobserver/server.py)

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "interrupted")
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "interrupted"})
RESUMABLE = frozenset({"failed", "cancelled", "interrupted"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    user TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    queued_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    error TEXT,
    exit_code INTEGER,
    max_steps INTEGER,
    source TEXT,
    nproc INTEGER NOT NULL DEFAULT 1,
    spec TEXT NOT NULL,
    resume INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    pid_start INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_user ON jobs (user, seq);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, queued_at);
"""


@dataclass
class Job:
    """One row of `jobs`. `spec` is what the runner needs to start it (argv pieces, archive to make)."""

    id: str
    user: str
    kind: str
    name: str
    status: str
    created_at: float
    queued_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    exit_code: int | None = None
    max_steps: int | None = None
    source: str | None = None
    nproc: int = 1
    spec: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    attempts: int = 0
    cancel_requested: bool = False
    pid: int | None = None
    pid_start: int | None = None
    seq: int = 0


_JOB_COLS = [f for f in Job.__dataclass_fields__]


def _row_to_job(row: sqlite3.Row) -> Job:
    d = dict(row)
    d["spec"] = json.loads(d["spec"])
    d["resume"], d["cancel_requested"] = bool(d["resume"]), bool(d["cancel_requested"])
    return Job(**{k: d[k] for k in _JOB_COLS})


class LockedDB:
    """One SQLite connection behind a lock (`self._db`, `self._lock`, set by the subclass): transactions
    that take the write lock at their start, and close."""

    _db: sqlite3.Connection
    _lock: threading.Lock

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")


class Store(LockedDB):
    """Tokens and jobs in `<workspace>/server.db`."""

    def __init__(self, workspace: str | Path) -> None:
        self.path = Path(workspace) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: the API's handlers and the runner's thread share this connection under
        # self._lock, which keeps one statement (or transaction) at a time.
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        try:
            self.path.chmod(0o600)  # token hashes: readable by the operator only
        except OSError:
            pass

    # -- tokens -----------------------------------------------------------------------------------
    def add_token(self, token_id: str, user: str, digest: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO tokens (id, user, hash, created_at) VALUES (?, ?, ?, ?)",
                       (token_id, user, digest, time.time()))

    def token(self, token_id: str) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute("SELECT * FROM tokens WHERE id = ?", (token_id,)).fetchone()

    def tokens(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT id, user, created_at, revoked_at FROM tokens ORDER BY created_at")
            return [dict(r) for r in rows.fetchall()]

    def revoke_token(self, token_id: str) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                             (time.time(), token_id))
            return cur.rowcount == 1

    # -- jobs -------------------------------------------------------------------------------------
    def add_job(self, job: Job) -> Job:
        row = {k: getattr(job, k) for k in _JOB_COLS if k != "seq"}
        row["spec"] = json.dumps(job.spec)
        with self._tx() as db:
            cur = db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                             tuple(row.values()))
            job.seq = cur.lastrowid
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _row_to_job(row) if row else None

    def list(self, user: str | None = None, status: str | None = None, after_seq: int | None = None,
             limit: int = 1000) -> list[Job]:
        """Jobs newest first; `after_seq` pages on (jobs older than that one)."""
        where, args = [], []
        if user is not None:
            where.append("user = ?")
            args.append(user)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if after_seq is not None:
            where.append("seq < ?")
            args.append(after_seq)
        sql = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit)).fetchall()
        return [_row_to_job(r) for r in rows]

    def queued(self) -> list[Job]:
        """Queued jobs, first in first out (a resumed job queues again at the back)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE status = 'queued' ORDER BY queued_at, seq")
            return [_row_to_job(r) for r in rows.fetchall()]

    def update(self, job_id: str, expect: str | tuple[str, ...] | None = None, **fields: Any) -> bool:
        """Set `fields` of a job; with `expect`, only while its status is one of those (a compare-and-set,
        so a cancel and the runner's own transition cannot both win). True if the row changed."""
        if "spec" in fields:
            fields["spec"] = json.dumps(fields["spec"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        sql, args = f"UPDATE jobs SET {sets} WHERE id = ?", [*fields.values(), job_id]
        if expect is not None:
            expect = (expect,) if isinstance(expect, str) else expect
            sql += f" AND status IN ({', '.join('?' * len(expect))})"
            args += list(expect)
        with self._tx() as db:
            return db.execute(sql, args).rowcount == 1

    def delete(self, job_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
