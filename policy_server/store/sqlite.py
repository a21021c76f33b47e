"""SQLite backend of the store: one WAL file under the data dir, one connection, one bounded lock.

Role: the embedded default (one policy server process on one machine, the demo). :class:`SqliteDB` opens
``data_dir/hindsight.sqlite3`` (created on first use, 0600 in a 0700 directory: every conversation is in
there), applies the schema migrations (policy_server.store.migrations) and owns the one connection and
its lock. ``_tx()`` is ONE ``BEGIN IMMEDIATE`` transaction under the store lock; ``_read()`` takes the lock
without a transaction. All methods are synchronous and short; the async server calls them through
``asyncio.to_thread`` (one connection guarded by a lock, so calls are serialised; SQLite would serialise
writers anyway).

Busy database (another process or connection holds the write lock: an operator's sqlite3 shell, a backup,
a second server on the same data dir): every wait is bounded by ``busy_timeout_s``, both for the store
lock (:class:`BoundedLock`) and for SQLite's own lock (its busy timeout), and ends in
:class:`~policy_server.errors.StoreBusy` (HTTP 503 with Retry-After). Every failure path releases the
store lock and leaves no transaction open (``BEGIN`` failed: nothing to undo; ``COMMIT`` failed: rolled
back), so the store serves again as soon as the other holder lets go. :meth:`SqliteDB.probe` is the
``/ready`` check: can a write transaction start within a short timeout right now.

Durability (``synchronous``): the store runs in WAL mode. With ``normal`` (the default) a commit has
written its WAL frames to the OS before it returns, so an accepted turn survives ``kill -9`` or any
crash of this process; only an OS crash or power loss may roll back the last commits (the database
stays consistent: SQLite guarantees that in WAL mode). ``full`` also fsyncs the WAL on every commit,
surviving power loss at ~1 ms per commit on ordinary disks. The contract "nothing accepted is lost
when the server is killed" holds for both; choose ``full`` where the host itself is not trusted.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from policy_server.errors import StoreBusy
from policy_server.store.base import StoreDB, yield_store
from policy_server.store.connection import DB
from policy_server.store.migrations import apply_migrations
from policy_server.store.turn_records import TurnCache, TurnRecords

logger = logging.getLogger(__name__)

# Pages one chunk of incremental vacuum returns to the filesystem, in one hold of the store: the most whose hold
# stays under 20 ms on the bench's machine, the rule of the sweep's batch (bench.retention, docs/USERS_DATA.md).
VACUUM_CHUNK_PAGES = 512
# A store created without incremental auto-vacuum (before this release) is rebuilt whole (VACUUM) once this share
# of its file is free: from half, VACUUM returns at least as many bytes as it copies (bench.retention).
VACUUM_FREE_FRACTION = 0.5
INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL


class SqliteDB(StoreDB):
    """The SQLite connection under ``data_dir/hindsight.sqlite3``; base of the SQLite :class:`Store`."""

    backend = "sqlite"

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
        self.turn_records = TurnRecords(TurnCache())
        self.on_ready = None
        self._lock = BoundedLock(busy_timeout_s)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
        self._db.row_factory = sqlite3.Row
        # Freed pages go back to the filesystem a bounded chunk at a time (_return_space). Only a database with no
        # table yet takes it at once; an older store keeps the wish and its next VACUUM applies it.
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self._db.execute("PRAGMA journal_mode=WAL")
        # See the module docstring: NORMAL survives a killed process, FULL also power loss.
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        # A deleted or purged row is overwritten, not just unlinked: users' deleted text must not linger in free
        # pages (docs/USERS_DATA.md).
        self._db.execute("PRAGMA secure_delete=ON")
        try:
            apply_migrations(self, real_type="REAL")
        except BaseException:
            self._db.close()
            raise
        for side in ("-wal", "-shm"):  # created by the first access under the process umask
            side_path = self.path.with_name(self.path.name + side)
            if side_path.exists():
                side_path.chmod(0o600)
        self.incremental_vacuum = self._auto_vacuum() == INCREMENTAL
        if not self.incremental_vacuum:
            logger.warning(
                "store %s was created without incremental auto-vacuum: retention returns its space with a full "
                "VACUUM (every turn waits, about 1 s per 165 MB) once half of it is free, which also converts it; "
                "`hindsight-policy migrate` converts it now (run it with the server stopped)",
                self.path,
            )

    def _auto_vacuum(self) -> int:
        with self._read() as db:
            return int(db.execute("PRAGMA auto_vacuum").fetchone()[0])

    def upgrade_file(self) -> str | None:
        """Offline upgrade of the file (``hindsight-policy migrate``, server stopped): a store created without
        incremental auto-vacuum is converted by one VACUUM, which holds the store all along; what was done, or
        None."""
        if self.incremental_vacuum:
            return None
        t0 = time.perf_counter()
        with self._lock:
            self._db.execute("VACUUM")  # applies the auto_vacuum the connection asked for at open
        self.incremental_vacuum = self._auto_vacuum() == INCREMENTAL
        return f"converted {self.path} to incremental auto-vacuum in {time.perf_counter() - t0:.1f}s"

    def _has_table(self, name: str) -> bool:
        with self._read() as db:
            return (
                db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None
            )

    def _serialise(self, db: DB, lock: int) -> None:
        """Every write transaction is a BEGIN IMMEDIATE one, which already excludes every other writer."""

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

    def _return_space(self, *, vacuum: bool) -> None:
        """Checkpoint the WAL into the file and truncate it (old page images of deleted rows go with it); with
        ``vacuum`` first return the file's free pages to the filesystem.

        Incremental auto-vacuum (every store this release creates) moves the pages at the end of the file into
        free ones and truncates, :data:`VACUUM_CHUNK_PAGES` at a time, each chunk one hold of the store, yielding
        between chunks (``yield_store``) like the sweep's batches: the cost follows the pages returned, not the
        file's size. A store without it is rebuilt by VACUUM (:meth:`_vacuum_whole`). Freed pages hold no deleted
        text meanwhile (``secure_delete`` zeroes them)."""
        if vacuum and self.incremental_vacuum:
            while self._vacuum_chunk() > VACUUM_CHUNK_PAGES:
                pass
        elif vacuum:
            self._vacuum_whole()
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _vacuum_chunk(self, pages: int | None = None) -> int:
        """One chunk of incremental vacuum (``pages`` at most, :data:`VACUUM_CHUNK_PAGES` by default) and its WAL
        checkpoint in one hold of the store, then the yield; returns the free pages it found (0: nothing done)."""
        pages = VACUUM_CHUNK_PAGES if pages is None else pages
        t0 = time.perf_counter()
        with self._lock:
            free = int(self._db.execute("PRAGMA freelist_count").fetchone()[0])
            if not free:
                return 0
            try:
                # The checkpoint copies the chunk's pages from the WAL into the file and truncates the file there;
                # left to SQLite's auto-checkpoint (every 1000 WAL pages), it would come in one hold several times
                # as long, in a chunk's or a concurrent turn's commit. executescript runs the vacuum to its end
                # (execute() stops after one page: it yields a row with no columns).
                self._db.executescript(f"PRAGMA incremental_vacuum({int(pages)}); PRAGMA wal_checkpoint(PASSIVE);")
            except sqlite3.OperationalError as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise _busy(exc) from None
        yield_store(t0)
        return free

    def _vacuum_whole(self) -> None:
        """VACUUM once :data:`VACUUM_FREE_FRACTION` of the file is free (a store created without incremental
        auto-vacuum). It copies every live page while holding the store (a second per 165 MB kept on the bench's
        2-core machine, whatever the free share), so the threshold bounds its cost to one byte copied per byte
        returned; it also converts the file to incremental auto-vacuum, asked for at open."""
        with self._lock:
            free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
            pages = self._db.execute("PRAGMA page_count").fetchone()[0]
            if not pages or free < VACUUM_FREE_FRACTION * pages:
                return
            self._db.execute("VACUUM")
        self.incremental_vacuum = self._auto_vacuum() == INCREMENTAL

    def file_bytes(self) -> int | None:
        return self.path.stat().st_size

    def _tx(self) -> _Tx:
        return _Tx(self)

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db


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

    def __init__(self, store: SqliteDB):
        self.store = store

    def __enter__(self) -> DB:
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
