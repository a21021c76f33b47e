"""PostgreSQL backend of the store: what lets several policy server replicas share one state.

Role: ``--store-url postgresql://user@host:port/db`` (psycopg 3 with a connection pool). Every replica
reads and writes the same tables (schema and migrations: policy_server.store.migrations, applied at
start under an advisory lock, so replicas starting together migrate once).

Concurrency: the role classes' SQL is shared with SQLite; here each ``_tx()`` is a READ COMMITTED
transaction on a pooled connection, and the read-then-write steps lock the rows they change
(``_for_update``: the session row when a turn takes the next index, the lease row when it is acked)
while claims (leases of ``ready`` samples, judge work, overdue leases) take unlocked rows only
(``FOR UPDATE SKIP LOCKED``): two replicas or trainers never get the same row, and a state change
guarded by ``WHERE status=...`` is decided by whichever transaction commits first. Migrations and the
weight-version ledger's changes, which decide on several rows, take a transaction-scoped advisory lock first
(``_serialise``), so they run one at a time across the replicas.

Waits: a pool connection, a row lock (``lock_timeout``) or a statement (``statement_timeout``) waits
at most ``busy_timeout_s``; a database that is down, slow or deadlocked ends in
:class:`~policy_server.errors.StoreBusy` (HTTP 503 with Retry-After), and the transaction is rolled back.
A pooled connection is checked as it is handed out (a server restart leaves the idle ones dead), so a
restart that is over is invisible to requests.

Wake-ups: a commit that made samples ``ready`` sends ``NOTIFY hindsight_ready``; a listener thread per
replica (``LISTEN`` on its own connection, reconnecting with a back-off) calls ``on_ready``, so a lease
long-poll at any replica wakes when the judge outcome was written by another one. After a reconnect it
calls ``on_ready`` once (a notification sent while it was away is not replayed by PostgreSQL).
Shared admin changes (reward mode, weight-sync pause: policy_server.serving.replicas) go the same way on
``hindsight_admin`` to ``on_admin``.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from policy_server.errors import StoreBusy
from policy_server.store.base import Row, StoreDB
from policy_server.store.connection import DB
from policy_server.store.migrations import apply_migrations
from policy_server.store.turn_records import TurnCache, TurnRecords

logger = logging.getLogger(__name__)

READY_CHANNEL = "hindsight_ready"
ADMIN_CHANNEL = "hindsight_admin"


def _row_factory(cursor: psycopg.Cursor[Row]) -> Callable[[Sequence[object]], Row]:
    names = tuple(d.name for d in cursor.description or ())
    return lambda values: Row(values, names)


@lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """SQLite-style placeholders to psycopg's: a literal ``%`` doubled, each ``?`` becomes ``%s``."""
    return sql.replace("%", "%%").replace("?", "%s")


class _Conn:
    """A psycopg connection with the sqlite3-style ``execute(sql, params)`` the role classes use."""

    def __init__(self, conn: psycopg.Connection[Row]):
        self._conn = conn

    def execute(self, sql: str, params: Sequence[object] = ()) -> psycopg.Cursor[Row]:
        if params:
            return self._conn.execute(_pg_sql(sql), tuple(params))
        return self._conn.execute(sql)

    def executemany(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        with self._conn.cursor() as cur:
            cur.executemany(_pg_sql(sql), rows)


def _check_idle_connection(conn: psycopg.Connection[Row]) -> None:
    """The pool's check as it hands out a connection: raise when the server has closed it.

    A restart or an operator's ``pg_terminate_backend`` leaves every idle pooled connection dead, and the first
    transaction on each would fail (a 503 to a live agent per pooled connection). The server says goodbye before it
    closes (or the kernel's end-of-file arrives): an idle connection that has anything to read is suspect and gets one
    round trip to tell; a quiet one costs a zero-timeout ``select`` and no round trip, so the hot path pays nothing.
    """
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    if readable:
        ConnectionPool.check_connection(conn)


class PostgresDB(StoreDB):
    """The PostgreSQL connection pool; base of :class:`~policy_server.store.PostgresStore`."""

    backend = "postgresql"
    _for_update = " FOR UPDATE"
    _skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, *, busy_timeout_s: float = 5.0, pool_size: int = 8, listen: bool = True):
        if busy_timeout_s <= 0:
            raise ValueError("busy_timeout_s must be > 0")
        self.url = url
        self.busy_timeout_s = busy_timeout_s
        self.turn_records = TurnRecords(TurnCache())
        self.on_ready = None
        timeout_ms = int(busy_timeout_s * 1000)

        def configure(conn: psycopg.Connection[Row]) -> None:
            conn.execute(f"SET lock_timeout = {timeout_ms}")
            conn.execute(f"SET statement_timeout = {timeout_ms * 2}")

        self._pool: ConnectionPool[psycopg.Connection[Row]] = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            timeout=busy_timeout_s,
            configure=configure,
            check=_check_idle_connection,
            open=False,
            kwargs={"autocommit": True, "row_factory": _row_factory},
            name="hindsight-store",
        )
        try:
            self._pool.open(wait=True, timeout=busy_timeout_s)
            apply_migrations(self, real_type="DOUBLE PRECISION")
        except PoolTimeout as exc:
            self._pool.close()
            raise StoreBusy(f"sample store unreachable: {exc}") from None
        except BaseException:
            self._pool.close()
            raise
        self._stop = threading.Event()
        self._listening = threading.Event()  # set once the listener's LISTEN statements ran
        self._listener: threading.Thread | None = None
        if listen:
            self._listener = threading.Thread(target=self._listen, name="store-listen", daemon=True)
            self._listener.start()
            # A store handed out before its listener listens would lose the notifications sent meanwhile
            # (PostgreSQL does not replay them), so a waiter woken by nothing would sleep to its timeout.
            if not self._listening.wait(busy_timeout_s):
                logger.warning("store listener not connected within %.1fs; it announces once it is", busy_timeout_s)

    # ------------------------------------------------------------------ transactions
    @contextmanager
    def _tx(self) -> Iterator[_Conn]:
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield _Conn(conn)
        except PoolTimeout as exc:
            raise StoreBusy(f"sample store busy: {exc}") from None
        except psycopg.OperationalError as exc:  # lock/statement timeout, deadlock, lost connection
            raise StoreBusy(f"sample store busy: {type(exc).__name__}: {exc}") from None

    _read = _tx  # a read is a transaction too: a consistent snapshot per statement, rolled back on error

    def _has_table(self, name: str) -> bool:
        with self._read() as db:
            row = db.execute("SELECT to_regclass(?)", (name,)).fetchone()  # always one row: NULL when absent
            return row is not None and row[0] is not None

    def _serialise(self, db: DB, lock: int) -> None:
        db.execute("SELECT pg_advisory_xact_lock(?)", (lock,))  # waits at most lock_timeout

    def probe(self, timeout_s: float = 0.5) -> str | None:
        """None when the database answers within ``timeout_s``, else why not (for ``/ready``)."""
        try:
            with self._pool.connection(timeout=timeout_s) as conn:
                conn.execute("SELECT 1")
        except PoolTimeout:
            return f"store busy: no database connection within {timeout_s:g}s"
        except psycopg.Error as exc:
            return f"store unavailable: {type(exc).__name__}: {exc}"
        return None

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=self.busy_timeout_s)
        self._pool.close(timeout=self.busy_timeout_s)

    # ------------------------------------------------------------------ wake-ups across replicas
    def _emit_ready(self) -> None:
        try:
            with self._pool.connection() as conn:
                conn.execute(f"NOTIFY {READY_CHANNEL}")
        except (PoolTimeout, psycopg.Error) as exc:
            # The samples are committed; waiters only learn later (their timeout or the next notification).
            logger.warning("could not notify lease waiters: %s", exc)
            if self.on_ready is not None:
                self.on_ready()

    def notify_admin(self) -> None:
        with self._tx() as db:
            db.execute(f"NOTIFY {ADMIN_CHANNEL}")

    def _dispatch(self, channel: str) -> None:
        callback = self.on_ready if channel == READY_CHANNEL else self.on_admin
        if callback is not None:
            callback()

    def _listen(self) -> None:
        backoff_s, reconnect = 0.1, False
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, int(self.busy_timeout_s))) as c:
                    c.execute(f"LISTEN {READY_CHANNEL}")
                    c.execute(f"LISTEN {ADMIN_CHANNEL}")
                    # Anything announced while no listener was connected: after a reconnect, or when the
                    # first connection came after the constructor stopped waiting for it.
                    if reconnect or not self._listening.is_set():
                        self._dispatch(READY_CHANNEL)
                        self._dispatch(ADMIN_CHANNEL)
                    self._listening.set()
                    backoff_s, reconnect = 0.1, True
                    while not self._stop.is_set():
                        for note in c.notifies(timeout=0.5):
                            self._dispatch(note.channel)
            except psycopg.Error as exc:
                if self._stop.is_set():
                    return
                logger.warning("store listener lost its connection (%s); reconnecting in %.1fs", exc, backoff_s)
                self._stop.wait(backoff_s)
                backoff_s = min(5.0, backoff_s * 2)
