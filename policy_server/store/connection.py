"""The connection the store's role classes use, typed: a result row, a cursor, a connection.

Role: the one interface a role class (sessions, samples, leases, reads, ...) writes its SQL against, whichever
backend runs it (policy_server.store.sqlite, policy_server.store.postgres); both backends' connections satisfy
it as they are. It sits below every other store module: it imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol


class DBRow(Protocol):
    """A result row: a column by name or position, or the row unpacked in column order. A column holds whatever
    SQL value its table declares, so its type is the one place a row stays untyped: the row mapping
    (policy_server.store.rows) reads each into its record's field."""

    def __getitem__(self, key: str | int, /) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...

    def keys(self) -> Iterable[str]: ...


class Cursor(Protocol):
    """The result of one statement."""

    @property
    def rowcount(self) -> int: ...

    # A DBRow, or None when the statement returned no row: typed as sqlite3 and psycopg type it, since most
    # reads are aggregates that always return their one row.
    def fetchone(self) -> Any: ...

    def fetchall(self) -> Sequence[DBRow]: ...

    def __iter__(self) -> Iterator[DBRow]: ...


class DB(Protocol):
    """A connection inside ``_tx()`` or ``_read()``: SQLite-style SQL (``?`` placeholders) on either backend."""

    def execute(self, sql: str, params: Sequence[object] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[object]], /) -> object: ...
