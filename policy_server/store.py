"""Durable SQLite (WAL) store for sessions, turns and training samples.

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

All methods are synchronous and short; the async server calls them through ``asyncio.to_thread``
(one connection guarded by a lock, so calls are serialised; SQLite would serialise writers anyway).
Each public write is ONE transaction: recording a main turn (session upsert, turn insert, rejection of
overtaken turns, session end) commits once, and so does resolving a pairing (with the activity touch).

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
import time
import uuid
from pathlib import Path
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


class LeaseError(Exception):
    """An ack that cannot be honoured; ``kind`` is ``unknown`` or ``expired``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Store:
    """The SQLite store under ``data_dir/hindsight.sqlite3`` (created on first use)."""

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

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> _Tx:
        return _Tx(self)

    # ------------------------------------------------------------------ sessions and turns
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
        return _turn_dict(row) if row else None

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

    def record_turn(self, session_id: str, record: dict[str, Any], *, session_done: bool, now: float | None = None) -> int:
        """Insert a main turn with the next turn index; returns that index. One transaction.

        The session is created or reopened (a new main turn revives a session an idle sweep ended while
        the turn was generated). A turn still ``awaiting`` in the same session at this point was overtaken
        by a concurrent request of the same session: it can no longer be paired reliably and is rejected
        explicitly. With ``session_done`` the new turn is the session's last: resolved with no next state.
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            _touch(db, session_id, now)
            idx = db.execute("SELECT next_turn_index FROM sessions WHERE session_id=?", (session_id,)).fetchone()[0]
            db.execute("UPDATE sessions SET next_turn_index=? WHERE session_id=?", (idx + 1, session_id))
            db.execute(
                "INSERT INTO turns (session_id, turn_index, created_at, record, pairing) VALUES (?, ?, ?, ?, 'awaiting')",
                (session_id, idx, now, _dump(record)),
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
        return _turn_dict(row) if row else None

    def session(self, session_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return dict(row) if row else None

    # ------------------------------------------------------------------ judge work
    def pending_jobs(self) -> list[dict[str, Any]]:
        """Every pending_judge sample in (session, turn) order, with the turn it belongs to."""
        with self._lock:
            rows = self._db.execute(
                "SELECT s.sample_id, s.session_id, s.turn_index, s.attempts FROM samples s "
                "WHERE s.status='pending_judge' ORDER BY s.session_id, s.turn_index"
            ).fetchall()
        return [dict(r) for r in rows]

    def note_attempt(self, sample_id: str, error: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE samples SET attempts=attempts+1, last_error=?, updated_at=? WHERE sample_id=?",
                (error[:500], time.time(), sample_id),
            )

    def complete_judge(
        self, sample_id: str, *, status: str, reject_reason: str | None, included: bool, data: dict[str, Any]
    ) -> bool:
        """Persist a judge outcome atomically with the sample's status and the session's at-least-one flag.

        ``pending_score`` (session-scope PRM) holds an accepted sample until its session is scored; it counts
        as included for the at-least-one rule, which follows the pipeline's decisions in judging order.
        """
        if status not in ("ready", "rejected", "pending_score"):
            raise ValueError(f"judge outcome status must be ready, rejected or pending_score, not {status!r}")
        with self._tx() as db:
            cur = db.execute(
                "UPDATE samples SET status=?, reject_reason=?, data=?, updated_at=? "
                "WHERE sample_id=? AND status='pending_judge'",
                (status, reject_reason, _dump(data), time.time(), sample_id),
            )
            if cur.rowcount and included:
                db.execute(
                    "UPDATE sessions SET has_included=1 WHERE session_id="
                    "(SELECT session_id FROM samples WHERE sample_id=?)",
                    (sample_id,),
                )
            return bool(cur.rowcount)

    # ------------------------------------------------------------------ session-scope scoring
    def scorable_sessions(self, session_id: str | None = None) -> list[str]:
        """Sessions (all, or just ``session_id``) whose held (``pending_score``) samples can be scored now: the
        session is done, no turn of it awaits its next state and none is ``pending_judge`` (all decided)."""
        only = "AND s.session_id=? " if session_id is not None else ""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT s.session_id FROM samples s JOIN sessions x ON x.session_id=s.session_id "
                "WHERE s.status='pending_score' AND x.done=1 " + only +
                "AND NOT EXISTS (SELECT 1 FROM samples p WHERE p.session_id=s.session_id AND p.status='pending_judge') "
                "AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id=s.session_id AND t.pairing='awaiting') "
                "ORDER BY s.session_id", (session_id,) if session_id is not None else ()
            ).fetchall()
        return [r[0] for r in rows]

    def session_trajectory(self, session_id: str) -> list[dict[str, Any]]:
        """Every recorded turn of the session in turn order, each a turn dict plus ``sample`` (its sample row
        with the Sample JSON in ``data``, or None while the turn awaits its next state)."""
        with self._lock:
            turns = self._db.execute(
                "SELECT * FROM turns WHERE session_id=? ORDER BY turn_index", (session_id,)
            ).fetchall()
            samples = {
                r["turn_index"]: dict(r)
                for r in self._db.execute("SELECT * FROM samples WHERE session_id=?", (session_id,)).fetchall()
            }
        out = []
        for row in turns:
            turn = _turn_dict(row)
            sample = samples.get(row["turn_index"])
            if sample is not None:
                sample["data"] = json.loads(sample["data"]) if sample["data"] else None
            turn["sample"] = sample
            out.append(turn)
        return out

    def note_score_attempt(self, session_id: str, error: str) -> int:
        """A failed scoring try of the session: every held sample gets attempts+1 and the error."""
        with self._tx() as db:
            return db.execute(
                "UPDATE samples SET attempts=attempts+1, last_error=?, updated_at=? "
                "WHERE session_id=? AND status='pending_score'",
                (error[:500], time.time(), session_id),
            ).rowcount

    def complete_score(self, outcomes: list[tuple[str, str, str | None, dict[str, Any]]]) -> int:
        """Decide held samples in ONE transaction: each ``(sample_id, status, reject_reason, data)`` with status
        ``ready`` or ``rejected``; a sample no longer ``pending_score`` is left alone. Returns how many moved."""
        for _, status, _, _ in outcomes:
            if status not in ("ready", "rejected"):
                raise ValueError(f"score outcome status must be ready or rejected, not {status!r}")
        now = time.time()
        with self._tx() as db:
            return sum(
                db.execute(
                    "UPDATE samples SET status=?, reject_reason=?, data=?, updated_at=? "
                    "WHERE sample_id=? AND status='pending_score'",
                    (status, reason, _dump(data), now, sample_id),
                ).rowcount
                for sample_id, status, reason, data in outcomes
            )

    # ------------------------------------------------------------------ leases
    def expire_leases(self, now: float | None = None) -> int:
        """Return the samples of every lease past its deadline to ``ready``; returns how many."""
        now = time.time() if now is None else now
        with self._tx() as db:
            rows = db.execute("SELECT lease_id FROM leases WHERE state='active' AND expires_at<=?", (now,)).fetchall()
            n = 0
            for (lease_id,) in rows:
                n += db.execute(
                    "UPDATE samples SET status='ready', lease_id=NULL, updated_at=? WHERE lease_id=? AND status='leased'",
                    (now, lease_id),
                ).rowcount
                db.execute("UPDATE leases SET state='expired' WHERE lease_id=?", (lease_id,))
            return n

    def lease(self, max_n: int, lease_s: float, now: float | None = None) -> tuple[str, list[dict[str, Any]]] | None:
        """Lease up to ``max_n`` ready samples (oldest first); None when none is ready."""
        now = time.time() if now is None else now
        self.expire_leases(now)
        with self._tx() as db:
            rows = db.execute(
                "SELECT sample_id, data FROM samples WHERE status='ready' ORDER BY created_at, sample_id LIMIT ?",
                (max_n,),
            ).fetchall()
            if not rows:
                return None
            lease_id = uuid.uuid4().hex
            ids = [r["sample_id"] for r in rows]
            db.executemany(
                "UPDATE samples SET status='leased', lease_id=?, updated_at=? WHERE sample_id=?",
                [(lease_id, now, i) for i in ids],
            )
            db.execute(
                "INSERT INTO leases (lease_id, created_at, expires_at, state, sample_ids) VALUES (?, ?, ?, 'active', ?)",
                (lease_id, now, now + lease_s, json.dumps(ids)),
            )
        return lease_id, [json.loads(r["data"]) for r in rows]

    def ack(self, lease_id: str, now: float | None = None) -> dict[str, Any]:
        """Consume a lease's samples. Idempotent for an acked lease; LeaseError if unknown or expired."""
        now = time.time() if now is None else now
        self.expire_leases(now)
        with self._tx() as db:
            row = db.execute("SELECT state, sample_ids FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
            if row is None:
                raise LeaseError("unknown", f"unknown lease_id {lease_id!r}")
            if row["state"] == "acked":
                return {"lease_id": lease_id, "acked": 0, "already_acked": True}
            if row["state"] == "expired":
                raise LeaseError("expired", f"lease {lease_id} expired; its samples were returned to ready")
            n = db.execute(
                "UPDATE samples SET status='consumed', updated_at=? WHERE lease_id=? AND status='leased'",
                (now, lease_id),
            ).rowcount
            db.execute("UPDATE leases SET state='acked' WHERE lease_id=?", (lease_id,))
        return {"lease_id": lease_id, "acked": n, "already_acked": False}

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        with self._lock:
            by_status = dict.fromkeys(SAMPLE_STATUSES, 0)
            for status, n in self._db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status"):
                by_status[status] = n
            reasons = {
                r: n
                for r, n in self._db.execute(
                    "SELECT reject_reason, COUNT(*) FROM samples WHERE status='rejected' GROUP BY reject_reason"
                )
            }
            awaiting = self._db.execute("SELECT COUNT(*) FROM turns WHERE pairing='awaiting'").fetchone()[0]
            turns = self._db.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
            sessions = self._db.execute("SELECT COUNT(*), SUM(done=0), SUM(mismatches) FROM sessions").fetchone()
            leases = self._db.execute("SELECT COUNT(*) FROM leases WHERE state='active'").fetchone()[0]
            retrying = self._db.execute(
                "SELECT COUNT(*) FROM samples WHERE status='pending_judge' AND attempts>0"
            ).fetchone()[0]
            score_retrying = self._db.execute(
                "SELECT COUNT(*) FROM samples WHERE status='pending_score' AND attempts>0"
            ).fetchone()[0]
        return {
            "samples": by_status,
            "reject_reasons": reasons,
            "turns": turns,
            "turns_awaiting_next_state": awaiting,
            "sessions": sessions[0],
            "sessions_open": sessions[1] or 0,
            "history_mismatches": sessions[2] or 0,
            "active_leases": leases,
            "pending_judge_retrying": retrying,
            "pending_score_retrying": score_retrying,
        }

    def unconsumed_backlog(self) -> int:
        """Samples accepted but not yet consumed (awaiting pairing, judging, scoring, ready or leased)."""
        with self._lock:
            n = self._db.execute(
                "SELECT COUNT(*) FROM samples WHERE status IN ('pending_judge','pending_score','ready','leased')"
            ).fetchone()[0]
            a = self._db.execute("SELECT COUNT(*) FROM turns WHERE pairing='awaiting'").fetchone()[0]
        return int(n) + int(a)

    def sample_row(self, sample_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM samples WHERE sample_id=?", (sample_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["data"] = json.loads(out["data"]) if out["data"] else None
        return out

    def list_samples(self, *, session_id: str | None = None, status: str | None = None,
                     limit: int = 100) -> list[dict[str, Any]]:
        """Read-only view of sample rows (no lease, no state change), oldest first, with their Sample JSON.

        Each row: sample_id, session_id, turn_index, status, reject_reason, attempts, last_error,
        created_at, updated_at, and ``sample`` (the Sample JSON once judged, else None).
        """
        if status is not None and status not in SAMPLE_STATUSES:
            raise ValueError(f"status must be one of {', '.join(SAMPLE_STATUSES)}, not {status!r}")
        where, args = [], []
        if session_id is not None:
            where.append("session_id=?")
            args.append(session_id)
        if status is not None:
            where.append("status=?")
            args.append(status)
        sql = ("SELECT sample_id, session_id, turn_index, status, reject_reason, attempts, last_error, created_at, "
               "updated_at, data FROM samples" + (" WHERE " + " AND ".join(where) if where else "") +
               (" ORDER BY turn_index" if session_id is not None else " ORDER BY created_at, session_id, turn_index")
               + " LIMIT ?")
        with self._lock:
            rows = self._db.execute(sql, (*args, int(limit))).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            data = d.pop("data")
            d["sample"] = json.loads(data) if data else None
            out.append(d)
        return out

    def samples_of(self, session_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sample_id FROM samples WHERE session_id=? ORDER BY turn_index", (session_id,)
            ).fetchall()
        return [r for r in (self.sample_row(x[0]) for x in rows) if r is not None]


class _Tx:
    """``with store._tx() as db``: one IMMEDIATE transaction under the store lock."""

    def __init__(self, store: Store):
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
        (pairing, note, _dump(next_state), int(session_done), session_id, turn_index),
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


def _dump(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj, ensure_ascii=False)


def _turn_dict(row: sqlite3.Row) -> dict[str, Any]:
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
