"""SQLite connection layer of the policy server's store: schema, durability, transactions, row codecs.

Role: everything the other store modules (policy_server.store, store_samples, store_leases, store_reads)
share. :class:`StoreDB` opens ``data_dir/hindsight.sqlite3`` (created on first use) in WAL mode, creates
the four tables (``sessions``, ``turns``, ``samples``, ``leases``; their states are described in
policy_server.store) and owns the one connection and its lock.

Transactions: ``with self._tx() as db`` is ONE ``BEGIN IMMEDIATE`` transaction under the store lock,
committed on normal exit and rolled back on an exception. Every public write of the store is exactly one
such transaction. Reads take the lock without a transaction. ``on_ready`` (a callable, or None) is called after every
committed write that made at least one sample ``ready`` (policy_server.ready_notifier wakes lease waiters
with it); it runs outside the lock and must not block. All methods are synchronous and short; the
async server calls them through ``asyncio.to_thread`` (one connection guarded by a lock, so calls are
serialised; SQLite would serialise writers anyway).

Durability (``synchronous``): the store runs in WAL mode. With ``normal`` (the default) a commit has
written its WAL frames to the OS before it returns, so an accepted turn survives ``kill -9`` or any
crash of this process; only an OS crash or power loss may roll back the last commits (the database
stays consistent: SQLite guarantees that in WAL mode). ``full`` also fsyncs the WAL on every commit,
surviving power loss at ~1 ms per commit on ordinary disks. The contract "nothing accepted is lost
when the server is killed" holds for both; choose ``full`` where the host itself is not trusted.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from collections.abc import Callable
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    next_turn_index INTEGER NOT NULL DEFAULT 0,
    last_activity REAL NOT NULL,
    done INTEGER NOT NULL DEFAULT 0,
    has_included INTEGER NOT NULL DEFAULT 0,
    mismatches INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    created_at REAL NOT NULL,
    record TEXT NOT NULL,
    pairing TEXT NOT NULL,
    pairing_note TEXT,
    next_state TEXT,
    session_done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, turn_index)
);
CREATE INDEX IF NOT EXISTS turns_awaiting ON turns (session_id, pairing);
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    status TEXT NOT NULL,
    reject_reason TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    lease_id TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    data TEXT,
    UNIQUE (session_id, turn_index)
);
CREATE INDEX IF NOT EXISTS samples_status ON samples (status, created_at);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    state TEXT NOT NULL,
    sample_ids TEXT NOT NULL
);
"""

SAMPLE_STATUSES = ("pending_judge", "pending_score", "ready", "leased", "consumed", "rejected")


class StoreDB:
    """The SQLite connection under ``data_dir/hindsight.sqlite3``; base of every store role class."""

    def __init__(self, data_dir: str | Path, *, synchronous: str = "normal"):
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be normal or full, not {synchronous!r}")
        path = Path(data_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "hindsight.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # See the module docstring: NORMAL survives a killed process, FULL also power loss.
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.executescript(SCHEMA)
        self.on_ready: Callable[[], None] | None = None

    def _ready_changed(self, n: int) -> None:
        """After a commit: tell the listener that ``n`` samples became ready (nothing when n is 0)."""
        if n and self.on_ready is not None:
            self.on_ready()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> _Tx:
        return _Tx(self)


class _Tx:
    """``with store._tx() as db``: one IMMEDIATE transaction under the store lock."""

    def __init__(self, store: StoreDB):
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        self.store._db.execute("BEGIN IMMEDIATE")
        return self.store._db

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            self.store._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.store._lock.release()


def dump_json(obj: Any) -> str | None:
    """JSON text of a column value (None stays NULL)."""
    return None if obj is None else json.dumps(obj, ensure_ascii=False)


def turn_dict(row: sqlite3.Row) -> dict[str, Any]:
    """A ``turns`` row as the turn dict: the stored record plus its session, index and pairing columns."""
    rec = json.loads(row["record"])
    rec.update(
        session_id=row["session_id"],
        turn_index=row["turn_index"],
        created_at=row["created_at"],
        pairing=row["pairing"],
        pairing_note=row["pairing_note"],
        next_state=json.loads(row["next_state"]) if row["next_state"] else None,
        session_done=bool(row["session_done"]),
    )
    return rec
