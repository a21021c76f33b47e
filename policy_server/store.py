"""Durable SQLite (WAL) store for sessions, turns and training samples: the public ``Store``.

Role: the single source of truth of the policy server. Everything the server accepts (a recorded
main turn, a judge outcome, a lease) is committed here before it is acknowledged, so a crash (even
``kill -9``) loses nothing and a restart resumes from the same state.

Contract (docs/CONTRACTS.md, issue 4 item 6):

- ``sessions``: one row per session id: next turn index, last activity, done flag, whether it already
  has an included sample (for the at-least-one rule), and the count of history mismatches.
- ``turns``: one row per recorded main turn (the token-exact record) with its pairing state
  ``awaiting`` (next state not known yet) -> ``paired`` | ``session_end`` | ``mismatch``.
- ``samples``: one row per turn whose pairing is resolved, with status
  ``pending_judge -> ready -> leased -> consumed``, or ``rejected`` with ``reject_reason``.
  ``data`` holds the Sample JSON of CONTRACTS.md once judged. With session-scope PRM scoring
  (policy_server.scoring) a turn the pipeline accepted waits as ``pending_judge -> pending_score`` (its
  Sample JSON stored, not leasable) until its session is over and every turn of it is decided
  (:meth:`Store.scorable_sessions`); then :meth:`Store.complete_score` makes all of the session's
  ``pending_score`` samples ``ready`` (with token_rewards) or ``rejected`` in ONE transaction.
- ``leases``: ``active -> acked`` or ``active -> expired``. Exactly-once: an acked sample is consumed
  and never leased again; a leased sample whose lease expires returns to ``ready``; acking twice is a
  no-op; acking an expired lease is refused (its samples may already be leased to someone else).

Layout: :class:`Store` is assembled from one class per role, all sharing one connection:

- this module: sessions and turns, i.e. the pairing half of the state machine (a turn is recorded
  ``awaiting``, then resolved, which creates its sample ``pending_judge`` or ``rejected``);
- policy_server.store_db: schema, connection, durability setting, the transaction helper, row codecs;
- policy_server.store_samples: judge and session-scope scoring outcomes (``pending_judge`` ->
  ``ready`` | ``rejected`` | ``pending_score``; ``pending_score`` -> ``ready`` | ``rejected``);
- policy_server.store_leases: ``ready`` -> ``leased`` -> ``consumed`` (or back to ``ready`` on expiry);
- policy_server.store_reads: stats, backlog and the read-only admin views (no state change).

Each public write is ONE transaction: recording a main turn (the pairing of the turn it answers, session
upsert, turn insert, rejection of overtaken turns, session end) commits once, so a continuing session costs
one commit per turn; resolving a pairing alone (with the activity touch) is one commit too.
Durability (``synchronous`` = ``normal`` | ``full``) is explained in policy_server.store_db.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass
from typing import Any

from policy_server.store_db import SAMPLE_STATUSES, SCHEMA, StoreDB, dump_json, turn_dict
from policy_server.store_leases import LeaseError, StoreLeases
from policy_server.store_reads import StoreReads
from policy_server.store_samples import StoreSamples

__all__ = ["SAMPLE_STATUSES", "SCHEMA", "LeaseError", "Resolution", "Store", "StoreDB"]


@dataclass(frozen=True)
class Resolution:
    """How an awaiting turn's pairing closes (see :meth:`Store.resolve_turn`), written with the next turn."""

    turn_index: int
    pairing: str
    next_state: list[dict[str, Any]] | None
    note: str | None = None
    reject_reason: str | None = None


class Store(StoreSamples, StoreLeases, StoreReads):
    """The SQLite store under ``data_dir/hindsight.sqlite3`` (created on first use).

    ``Store(data_dir, synchronous="normal")``; the constructor, ``close`` and ``path`` come from
    :class:`~policy_server.store_db.StoreDB`, the other role methods from the classes listed above.
    """

    def touch_session(self, session_id: str, now: float | None = None) -> None:
        """Create the session if new, reopen it if it was done, and refresh its activity time."""
        now = time.time() if now is None else now
        with self._tx() as db:
            _touch(db, session_id, now)

    def awaiting_turn(self, session_id: str) -> dict[str, Any] | None:
        """The session's latest turn still waiting for its next state, as a turn dict."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM turns WHERE session_id=? AND pairing='awaiting' ORDER BY turn_index DESC LIMIT 1",
                (session_id,),
            ).fetchone()
        return turn_dict(row) if row else None

    def resolve_turn(
        self,
        session_id: str,
        turn_index: int,
        *,
        pairing: str,
        next_state: list[dict[str, Any]] | None,
        session_done: bool,
        note: str | None = None,
        reject_reason: str | None = None,
        now: float | None = None,
        touch: bool = False,
    ) -> str | None:
        """Close a turn's pairing and create its sample (pending_judge, or rejected with a reason).

        ``touch`` also refreshes the session's activity time (and reopens it) in the same transaction.
        Returns the sample id, or None when the turn was already resolved (idempotent under races).
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            if touch:
                _touch(db, session_id, now)
            return _resolve(db, session_id, turn_index, pairing=pairing, next_state=next_state,
                            session_done=session_done, note=note, reject_reason=reject_reason, now=now)

    def record_turn(self, session_id: str, record: dict[str, Any], *, session_done: bool, now: float | None = None,
                    resolve: Resolution | None = None) -> int:
        """Insert a main turn with the next turn index; returns that index. One transaction.

        ``resolve`` first closes the pairing of the turn this one answers (as :meth:`resolve_turn` would; a no-op
        when that turn was resolved meanwhile), in the same transaction: one commit per continuing turn.

        The session is created or reopened (a new main turn revives a session an idle sweep ended while
        the turn was generated). A turn still ``awaiting`` in the same session at this point was overtaken
        by a concurrent request of the same session: it can no longer be paired reliably and is rejected
        explicitly. With ``session_done`` the new turn is the session's last: resolved with no next state.
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            _touch(db, session_id, now)
            if resolve is not None:
                _resolve(db, session_id, resolve.turn_index, pairing=resolve.pairing, next_state=resolve.next_state,
                         session_done=False, note=resolve.note, reject_reason=resolve.reject_reason, now=now)
            idx = db.execute("SELECT next_turn_index FROM sessions WHERE session_id=?", (session_id,)).fetchone()[0]
            db.execute("UPDATE sessions SET next_turn_index=? WHERE session_id=?", (idx + 1, session_id))
            db.execute(
                "INSERT INTO turns (session_id, turn_index, created_at, record, pairing) VALUES (?, ?, ?, ?, 'awaiting')",
                (session_id, idx, now, dump_json(record)),
            )
            older = db.execute(
                "SELECT turn_index FROM turns WHERE session_id=? AND pairing='awaiting' AND turn_index<?",
                (session_id, idx),
            ).fetchall()
            for (o,) in older:
                _resolve(db, session_id, o, pairing="mismatch", next_state=None, session_done=False,
                         note="overtaken by a concurrent turn", reject_reason="concurrent_turns", now=now)
            if session_done:
                _end(db, session_id, now)
        return idx

    def end_session(self, session_id: str, *, now: float | None = None) -> list[str]:
        """Mark the session done; its awaiting turn becomes the last turn (no next state). One transaction."""
        now = time.time() if now is None else now
        with self._tx() as db:
            return _end(db, session_id, now)

    def idle_sessions(self, idle_before: float) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions WHERE done=0 AND last_activity<?", (idle_before,)
            ).fetchall()
        return [r[0] for r in rows]

    def get_turn(self, session_id: str, turn_index: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM turns WHERE session_id=? AND turn_index=?", (session_id, turn_index)
            ).fetchone()
        return turn_dict(row) if row else None

    def session(self, session_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return dict(row) if row else None


def _touch(db: sqlite3.Connection, session_id: str, now: float) -> None:
    db.execute(
        "INSERT INTO sessions (session_id, last_activity) VALUES (?, ?) "
        "ON CONFLICT(session_id) DO UPDATE SET last_activity=excluded.last_activity, done=0",
        (session_id, now),
    )


def _resolve(db: sqlite3.Connection, session_id: str, turn_index: int, *, pairing: str,
             next_state: list[dict[str, Any]] | None, session_done: bool, note: str | None,
             reject_reason: str | None, now: float) -> str | None:
    """Inside a transaction: see Store.resolve_turn."""
    cur = db.execute(
        "UPDATE turns SET pairing=?, pairing_note=?, next_state=?, session_done=? "
        "WHERE session_id=? AND turn_index=? AND pairing='awaiting'",
        (pairing, note, dump_json(next_state), int(session_done), session_id, turn_index),
    )
    if cur.rowcount == 0:
        return None
    if pairing == "mismatch":
        db.execute("UPDATE sessions SET mismatches=mismatches+1 WHERE session_id=?", (session_id,))
    sample_id = uuid.uuid4().hex
    status = "rejected" if reject_reason else "pending_judge"
    db.execute(
        "INSERT INTO samples (sample_id, session_id, turn_index, status, reject_reason, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (sample_id, session_id, turn_index, status, reject_reason, now, now),
    )
    return sample_id


def _end(db: sqlite3.Connection, session_id: str, now: float) -> list[str]:
    """Inside a transaction: see Store.end_session."""
    db.execute("UPDATE sessions SET done=1 WHERE session_id=?", (session_id,))
    rows = db.execute("SELECT turn_index FROM turns WHERE session_id=? AND pairing='awaiting'", (session_id,)).fetchall()
    out = []
    for (idx,) in rows:
        sid = _resolve(db, session_id, idx, pairing="session_end", next_state=None, session_done=True, note=None,
                       reject_reason=None, now=now)
        if sid:
            out.append(sid)
    return out
