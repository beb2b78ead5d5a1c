"""The daemon's journal of pending work: SQLite (stdlib) in WAL mode, one row per task.

A task is ``(kind, root, step, target)``, unique: ``kind`` is ``promote`` or ``replicate``, ``target`` the
URL of the tier it writes to. States::

    pending --claim--> running --finish--> done
                               --fail----> failed (retry_at) --claim, once due--> running
                               --give_up-> failed for good (retry_at NULL: never claimed again)
                               --skip----> skipped (reason)

A task failed for good (its source copy is corrupt, its tier holds a different step with its number) keeps
its error for the status document and its step's pin; a restarted daemon gives it one more attempt
(:meth:`Journal.retry_given_up`), the operator may have mended the cause.

Every change is a transaction with ``synchronous=FULL``: once :meth:`Journal.enqueue` returns, the task
survives a power loss. A daemon killed while a task ran finds it ``running`` at the next start;
:meth:`Journal.requeue_running` puts it back to ``pending`` (the work itself is idempotent: a promotion or a
replication of a step already committed on its tier only checks and returns), so each step ends committed
once per tier and its task ``done`` once.

Thread safety: one connection per thread (``threading.local``); SQLite serialises the writers, and each
write waits for the lock up to ``busy_timeout``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.errors import ConfigError

#: Kinds of task.
KINDS = ("promote", "replicate")
#: States of a task.
STATES = ("pending", "running", "done", "failed", "skipped")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('promote', 'replicate')),
    root TEXT NOT NULL,
    step INTEGER NOT NULL,
    target TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'running', 'done', 'failed', 'skipped')),
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    retry_at REAL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    finished REAL,
    result TEXT,
    UNIQUE (kind, root, step, target)
);
CREATE INDEX IF NOT EXISTS tasks_by_state ON tasks (state, kind);
CREATE TABLE IF NOT EXISTS state (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class Task:
    """One row of the journal (see the module docstring)."""

    id: int
    kind: str
    root: str
    step: int
    target: str
    state: str
    attempts: int
    error: str | None
    retry_at: float | None
    created: float
    updated: float
    finished: float | None = None


@dataclass(frozen=True)
class TaskError:
    """A failure kept for the status document."""

    kind: str
    root: str
    step: int
    target: str
    error: str
    attempts: int
    when: float
    retry_at: float | None


_TASK_COLUMNS = "id, kind, root, step, target, state, attempts, error, retry_at, created, updated, finished"


class Journal:
    """The task table in ``path`` (created on first use). Call :meth:`close` from each thread that used it,
    or once at the end (connections of finished threads are closed with it)."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        try:
            connection = self._connection()
            connection.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise ConfigError(f"cannot open the daemon's journal: {exc}", path=str(self.path),
                              hint="check state_dir; a damaged journal can be moved aside (pending work is then "
                                   "found again by the start rescan)") from exc

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                         check_same_thread=False)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            self._local.connection = connection
            with self._lock:
                self._connections.append(connection)
        return connection

    def _write(self, sql: str, parameters: Iterable[Any] = ()) -> sqlite3.Cursor:
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            cursor = connection.execute(sql, tuple(parameters))
            connection.execute("COMMIT")
            return cursor
        except BaseException:
            connection.execute("ROLLBACK")
            raise

    # --- tasks -------------------------------------------------------------------------------------
    def enqueue(self, kind: str, root: str, step: int, target: str) -> bool:
        """Journal a pending task; False when that task (any state) is already journaled."""
        if kind not in KINDS:
            raise ValueError(f"unknown task kind {kind!r}; choose one of {KINDS}")
        now = time.time()
        cursor = self._write("INSERT OR IGNORE INTO tasks (kind, root, step, target, created, updated) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (kind, root, step, target, now, now))
        return cursor.rowcount == 1

    def claim(self, kinds: Iterable[str], *, now: float | None = None) -> Task | None:
        """Take the oldest runnable task of ``kinds`` (pending, or failed and due), lowest step first, and mark
        it running; None when there is none."""
        kinds = tuple(kinds)
        now = time.time() if now is None else now
        marks = ", ".join("?" for _ in kinds)
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            row = connection.execute(
                f"SELECT {_TASK_COLUMNS} FROM tasks WHERE kind IN ({marks}) AND (state = 'pending' OR "
                "(state = 'failed' AND retry_at <= ?)) ORDER BY step, id LIMIT 1", (*kinds, now)).fetchone()
            if row is None:
                connection.execute("COMMIT")
                return None
            connection.execute("UPDATE tasks SET state = 'running', attempts = attempts + 1, updated = ? WHERE id = ?",
                               (now, row[0]))
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        task = Task(*row)
        return Task(**{**task.__dict__, "state": "running", "attempts": task.attempts + 1, "updated": now})

    def finish(self, task_id: int, result: dict[str, Any] | None = None) -> None:
        """Mark a running task done (``result``: a JSON-able record of what it did)."""
        now = time.time()
        self._write("UPDATE tasks SET state = 'done', error = NULL, retry_at = NULL, finished = ?, updated = ?, "
                    "result = ? WHERE id = ?", (now, now, json.dumps(result) if result is not None else None, task_id))

    def fail(self, task_id: int, error: str, retry_at: float) -> None:
        """Mark a running task failed; it becomes runnable again at ``retry_at`` (seconds since the epoch)."""
        self._write("UPDATE tasks SET state = 'failed', error = ?, retry_at = ?, updated = ? WHERE id = ?",
                    (error, retry_at, time.time(), task_id))

    def give_up(self, task_id: int, error: str) -> None:
        """Mark a running task failed for good: kept with ``error``, never claimed again by this run."""
        self._write("UPDATE tasks SET state = 'failed', error = ?, retry_at = NULL, updated = ? WHERE id = ?",
                    (error, time.time(), task_id))

    def retry_given_up(self) -> int:
        """At start: tasks failed for good get one more attempt now; returns how many."""
        now = time.time()
        return self._write("UPDATE tasks SET retry_at = ?, updated = ? WHERE state = 'failed' AND retry_at IS NULL",
                           (now, now)).rowcount

    def skip(self, task_id: int, reason: str) -> None:
        """Mark a task skipped for good (its step is gone from every copy, or its tier was removed)."""
        now = time.time()
        self._write("UPDATE tasks SET state = 'skipped', error = ?, retry_at = NULL, finished = ?, updated = ? "
                    "WHERE id = ?", (reason, now, now, task_id))

    def skip_open(self, root: str, step: int, reason: str) -> int:
        """Skip the pending and failed tasks of a step (not a running one); returns how many."""
        now = time.time()
        return self._write("UPDATE tasks SET state = 'skipped', error = ?, retry_at = NULL, finished = ?, updated = ? "
                           "WHERE root = ? AND step = ? AND state IN ('pending', 'failed')",
                           (reason, now, now, root, step)).rowcount

    def requeue_running(self) -> int:
        """At start: tasks left running by a daemon that died go back to pending; returns how many."""
        return self._write("UPDATE tasks SET state = 'pending', updated = ? WHERE state = 'running'",
                           (time.time(),)).rowcount

    # --- queries -----------------------------------------------------------------------------------
    def tasks(self, *, root: str | None = None, step: int | None = None, kind: str | None = None) -> list[Task]:
        """Tasks matching the filters, by id."""
        clauses, parameters = [], []
        for column, value in (("root", root), ("step", step), ("kind", kind)):
            if value is not None:
                clauses.append(f"{column} = ?")
                parameters.append(value)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._connection().execute(f"SELECT {_TASK_COLUMNS} FROM tasks{where} ORDER BY id", parameters)
        return [Task(*row) for row in rows.fetchall()]

    def open_tasks(self, root: str, step: int) -> int:
        """How many tasks of a step are not finished (pending, running or failed)."""
        row = self._connection().execute(
            "SELECT COUNT(*) FROM tasks WHERE root = ? AND step = ? AND state IN ('pending', 'running', 'failed')",
            (root, step)).fetchone()
        return int(row[0])

    def open_steps(self, root: str) -> list[int]:
        """Steps of ``root`` with an unfinished task, ascending."""
        rows = self._connection().execute(
            "SELECT DISTINCT step FROM tasks WHERE root = ? AND state IN ('pending', 'running', 'failed') "
            "ORDER BY step", (root,)).fetchall()
        return [int(row[0]) for row in rows]

    def depth(self) -> dict[str, dict[str, int]]:
        """kind -> state -> number of tasks (every kind and state present, zeros included)."""
        counts = {kind: {state: 0 for state in STATES} for kind in KINDS}
        for kind, state, count in self._connection().execute(
                "SELECT kind, state, COUNT(*) FROM tasks GROUP BY kind, state").fetchall():
            counts[kind][state] = int(count)
        return counts

    def recent_errors(self, count: int = 10) -> list[TaskError]:
        """The latest failures still failed (newest first)."""
        rows = self._connection().execute(
            "SELECT kind, root, step, target, error, attempts, updated, retry_at FROM tasks "
            "WHERE state = 'failed' ORDER BY updated DESC LIMIT ?", (count,)).fetchall()
        return [TaskError(*row) for row in rows]

    def done_steps(self, kind: str, root: str) -> list[int]:
        """Steps of ``root`` whose ``kind`` task is done, ascending."""
        rows = self._connection().execute(
            "SELECT DISTINCT step FROM tasks WHERE kind = ? AND root = ? AND state = 'done' ORDER BY step",
            (kind, root)).fetchall()
        return [int(row[0]) for row in rows]

    # --- small persistent state ----------------------------------------------------------------------
    def set_state(self, key: str, value: Any) -> None:
        """Keep a JSON-able value under ``key`` across restarts."""
        self._write("INSERT INTO state (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, json.dumps(value)))

    def get_state(self, key: str, default: Any = None) -> Any:
        row = self._connection().execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def close(self) -> None:
        """Close every connection this journal opened."""
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            try:
                connection.close()
            except sqlite3.Error:
                pass
        self._local = threading.local()
