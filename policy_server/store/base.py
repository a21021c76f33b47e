"""The backend-neutral base of the store: connection interface, transactions, row codecs, runtime settings.

Role: what every store role class (sessions, samples, leases, reads) builds on. A backend
(policy_server.store.sqlite, policy_server.store.postgres) subclasses :class:`StoreDB` and provides:

- ``_tx()``: ``with self._tx() as db`` is ONE write transaction, committed on normal exit and rolled back on
  an exception; every public write of the store is exactly one such transaction. A wait for the database
  (a lock, a pool connection) is bounded by ``busy_timeout_s`` and ends in
  :class:`~policy_server.errors.StoreBusy` (HTTP 503 with Retry-After).
- ``_read()``: ``with self._read() as db`` gives a connection for a consistent read (no write).
- ``probe(timeout_s)``: None when a write transaction can start now, else why not (``/ready``).
- ``close()``, and ``_emit_ready()``: how "samples became ready" reaches ``on_ready`` (directly in one
  process; through PostgreSQL ``NOTIFY`` to every replica).

``db.execute(sql, params)`` takes SQLite-style SQL (``?`` placeholders) in both backends, and rows support
``row["col"]``, ``row[0]``, tuple unpacking and ``dict(row)``. The SQL of the role classes is written in the
common subset of SQLite and PostgreSQL; the two places where they differ are the class attributes
``_for_update`` (row locks taken by a read-then-write, so that concurrent replicas serialise on the rows they
change: empty in SQLite, whose write transactions are serialised anyway) and ``_skip_locked`` (a claim query
skips rows another transaction holds). A change that decides on several rows at once (a migration, a change of the
weight-version ledger) takes a named lock instead, ``_serialise(db, lock)``: held to the end of the transaction,
so such changes run one after another at every process (a no-op in SQLite, for the same reason).

``on_ready`` (a callable, or None) is called after every committed write that made at least one sample
``ready`` (policy_server.store.ready_notifier wakes lease waiters with it); ``on_admin`` after a change of shared
admin state (policy_server.serving.replicas). Both must not block; with PostgreSQL they run at every replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from engine import fastjson
from engine.records import SAMPLE_STATUSES
from policy_server.store.connection import DB

if TYPE_CHECKING:
    from policy_server.store.turn_records import TurnRecords

__all__ = ["LEDGER_LOCK", "SAMPLE_STATUSES", "SCHEMA_LOCK", "Row", "StoreDB", "dump_json", "yield_store"]

R = TypeVar("R", bound=BaseModel)  # a runtime setting's record

# The locks of ``StoreDB._serialise`` (PostgreSQL advisory lock keys: arbitrary constants, distinct).
SCHEMA_LOCK = 0x48696E64  # schema migrations
LEDGER_LOCK = 0x48696E65  # changes of the weight-version ledger (policy_server.store.versions)


class StoreDB:
    """Backend interface shared by the store role classes (see the module docstring)."""

    _for_update = ""
    _skip_locked = ""
    busy_timeout_s: float
    turn_records: TurnRecords  # whole turn records, cached (policy_server.store.turn_records)
    on_ready: Callable[[], None] | None = None
    on_admin: Callable[[], None] | None = None

    def _tx(self) -> AbstractContextManager[DB]:
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[DB]:
        raise NotImplementedError

    def _has_table(self, name: str) -> bool:
        raise NotImplementedError

    def _serialise(self, db: DB, lock: int) -> None:
        """First statement of a write transaction: wait until no other transaction holding ``lock`` (``SCHEMA_LOCK``,
        ``LEDGER_LOCK``) runs, at any process; the lock is released at commit or rollback, and the wait is bounded by
        ``busy_timeout_s`` like any lock wait."""
        raise NotImplementedError

    def probe(self, timeout_s: float = 0.5) -> str | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _return_space(self, *, vacuum: bool) -> None:
        """After rows were deleted: no old copy of them left in a log, and with ``vacuum`` the freed space
        given back to the filesystem, where the backend can (SQLite); PostgreSQL's autovacuum reuses it."""

    def upgrade_file(self) -> str | None:
        """Offline upgrade of the database file, for ``hindsight-policy migrate`` (the server stopped): what was
        done, or None (nothing to do, or a backend without such a file)."""
        return None

    def file_bytes(self) -> int | None:
        """The database file's size in bytes (SQLite), None where the backend has no such file."""
        return None

    def _emit_ready(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def _ready_changed(self, n: int) -> None:
        """After a commit: tell the listeners that ``n`` samples became ready (nothing when n is 0)."""
        if n:
            self._emit_ready()

    def notify_admin(self) -> None:
        """Announce a change of shared admin state (``runtime``) to every replica's ``on_admin``."""
        if self.on_admin is not None:
            self.on_admin()

    def runtime_keys(self, prefix: str) -> list[str]:
        """The runtime keys starting with ``prefix``, prefix removed (e.g. the replicas that reported in)."""
        with self._read() as db:
            rows = db.execute("SELECT key FROM runtime WHERE key LIKE ?", (prefix + "%",)).fetchall()
        return sorted(r[0][len(prefix) :] for r in rows if r[0].startswith(prefix))

    def get_runtime(self, key: str, kind: type[R]) -> R | None:
        """A runtime setting (e.g. the reward mode) read as its record ``kind``, or None if never set. A stored
        value off ``kind``'s schema raises ``pydantic.ValidationError`` (loud, never half-read)."""
        with self._read() as db:
            row = db.execute("SELECT value FROM runtime WHERE key=?", (key,)).fetchone()
        return kind.model_validate_json(row["value"]) if row else None

    def delete_runtime(self, key: str) -> None:
        """Forget a runtime setting (one transaction; nothing happens when it is not set)."""
        with self._tx() as db:
            db.execute("DELETE FROM runtime WHERE key=?", (key,))

    def set_runtime(self, key: str, value: BaseModel) -> None:
        """Persist a runtime setting (its record's JSON), so it survives a restart and every replica sees it
        (one transaction)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO runtime (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, value.model_dump_json()),
            )


class Row(tuple[object, ...]):
    """A result row readable by position, by column name, and as a mapping (``dict(row)``)."""

    _names: tuple[str, ...]

    def __new__(cls, values: Iterable[object], names: tuple[str, ...]) -> Row:
        row = super().__new__(cls, values)
        row._names = names
        return row

    def keys(self) -> tuple[str, ...]:
        return self._names

    def __getitem__(self, key: str | int) -> Any:  # type: ignore[override]  # by name too, one column at a time
        if isinstance(key, str):
            return tuple.__getitem__(self, self._names.index(key))
        return tuple.__getitem__(self, key)


def dump_json(obj: object) -> str | None:
    """JSON text of a column value (None stays NULL); a record's prompt ids by the fast encoder."""
    return None if obj is None else fastjson.dumps(obj, ensure_ascii=False)


def yield_store(since: float) -> None:
    """Between two bounded holds of the store by one long job (a retention sweep's batches, SQLite's vacuum
    chunks), the first begun at ``since`` (``time.perf_counter()``): sleep as long as it held. The writers that
    queued meanwhile get in (a released lock is otherwise taken again by the job before a waiter wakes up), and
    the job never takes more than half of the store's time."""
    time.sleep(max(0.0, time.perf_counter() - since))
