"""SQLite connection layer of the policy server's store: schema, durability, transactions, row codecs.

Role: everything the other store modules (policy_server.store, store_samples, store_leases, store_reads)
share. :class:`StoreDB` opens ``data_dir/hindsight.sqlite3`` (created on first use) in WAL mode, creates
the tables (``sessions``, ``turns``, ``samples``, ``leases``, whose states are described in
policy_server.store, and ``runtime``: admin changes that must survive a restart, such as the reward
mode) and owns the one connection and its lock.

Transactions: ``with self._tx() as db`` is ONE ``BEGIN IMMEDIATE`` transaction under the store lock,
committed on normal exit and rolled back on an exception. Every public write of the store is exactly one
such transaction. Reads take the lock without a transaction. ``on_ready`` (a callable, or None) is called after every
committed write that made at least one sample ``ready`` (policy_server.ready_notifier wakes lease waiters
with it); it runs outside the lock and must not block. All methods are synchronous and short; the
async server calls them through ``asyncio.to_thread`` (one connection guarded by a lock, so calls are
serialised; SQLite would serialise writers anyway).

Busy database (another process or connection holds the write lock: an operator's sqlite3 shell, a backup,
a second server on the same data dir): every wait is bounded by ``busy_timeout_s``, both for the store
lock (:class:`BoundedLock`) and for SQLite's own lock (its busy timeout), and ends in
:class:`~policy_server.errors.StoreBusy` (HTTP 503 with Retry-After). Every failure path releases the
store lock and leaves no transaction open (``BEGIN`` failed: nothing to undo; ``COMMIT`` failed: rolled
back), so the store serves again as soon as the other holder lets go. :meth:`StoreDB.probe` is the
``/ready`` check: can a write transaction start within a short timeout right now.

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

from policy_server.errors import StoreBusy

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
CREATE TABLE IF NOT EXISTS runtime (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
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

    def __init__(self, data_dir: str | Path, *, synchronous: str = "normal", busy_timeout_s: float = 5.0):
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be normal or full, not {synchronous!r}")
        if busy_timeout_s <= 0:
            raise ValueError("busy_timeout_s must be > 0")
        path = Path(data_dir)
        path.mkdir(parents=True, exist_ok=True)
        # Every conversation is in here: only the server's user may read it (the directory too, since
        # SQLite creates its -wal/-shm files next to the database with the process umask).
        path.chmod(0o700)
        self.path = path / "hindsight.sqlite3"
        self.path.touch(mode=0o600, exist_ok=True)
        self.path.chmod(0o600)
        self.busy_timeout_s = busy_timeout_s
        self._lock = BoundedLock(busy_timeout_s)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # See the module docstring: NORMAL survives a killed process, FULL also power loss.
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.executescript(SCHEMA)
        for side in ("-wal", "-shm"):  # created by the first access under the process umask
            side_path = self.path.with_name(self.path.name + side)
            if side_path.exists():
                side_path.chmod(0o600)
        self.on_ready: Callable[[], None] | None = None

    def _ready_changed(self, n: int) -> None:
        """After a commit: tell the listener that ``n`` samples became ready (nothing when n is 0)."""
        if n and self.on_ready is not None:
            self.on_ready()

    def close(self) -> None:
        # Bounded like every other wait: a shutdown never hangs on a store call that is still stuck.
        if self._lock.acquire(timeout=self.busy_timeout_s):
            try:
                self._db.close()
            finally:
                self._lock.release()

    def probe(self, timeout_s: float = 0.5) -> str | None:
        """None when a write transaction can start within ``timeout_s`` now, else why not (for ``/ready``)."""
        if not self._lock.acquire(timeout=timeout_s):
            return "store busy: a store call holds the connection"
        try:
            self._db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("ROLLBACK")
            except sqlite3.OperationalError as exc:
                return f"store busy: {exc}"
            finally:
                self._db.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            return None
        finally:
            self._lock.release()

    def _tx(self) -> _Tx:
        return _Tx(self)

    def get_runtime(self, key: str) -> Any:
        """A runtime setting changed through the admin API (e.g. the reward mode), or None if never set."""
        with self._lock:
            row = self._db.execute("SELECT value FROM runtime WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else None

    def set_runtime(self, key: str, value: Any) -> None:
        """Persist a runtime setting, so it survives a restart (one transaction)."""
        with self._tx() as db:
            db.execute("INSERT INTO runtime (key, value) VALUES (?, ?) "
                       "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, json.dumps(value)))


class BoundedLock:
    """The store lock: ``with lock:`` waits at most ``timeout_s``, then raises StoreBusy (never blocks forever)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def acquire(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> BoundedLock:
        if not self._lock.acquire(timeout=self.timeout_s):
            raise StoreBusy(f"sample store busy: no store access within {self.timeout_s:g}s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _busy(exc: sqlite3.OperationalError) -> StoreBusy:
    return StoreBusy(f"sample store busy: {exc}")


class _Tx:
    """``with store._tx() as db``: one IMMEDIATE transaction under the store lock; every path releases it."""

    def __init__(self, store: StoreDB):
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.__enter__()
        try:
            self.store._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            # SQLite's busy timeout ran out (another connection holds the write lock): no transaction was
            # opened, so there is nothing to roll back; the store lock must not stay taken.
            self.store._lock.release()
            raise _busy(exc) from None
        except BaseException:
            self.store._lock.release()
            raise
        return self.store._db

    def __exit__(self, exc_type: object, *rest: object) -> None:
        db = self.store._db
        try:
            if exc_type:
                db.execute("ROLLBACK")
                return
            try:
                db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                if db.in_transaction:  # a COMMIT that could not get its lock leaves the transaction open
                    db.execute("ROLLBACK")
                raise _busy(exc) from None
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
