"""Sessions and turns: the pairing half of the sample state machine (a Store role class).

Role: a turn is recorded ``awaiting`` (its next state not known yet), then resolved ``paired`` |
``session_end`` | ``mismatch``, which creates its sample ``pending_judge`` (or ``rejected`` with a reason);
the idle sweep ends sessions. States of every table: policy_server.store.

Each public write is ONE transaction: recording a main turn (the pairing of the turn it answers, session
upsert, turn insert, rejection of overtaken turns, session end) commits once, so a continuing session costs
one commit per turn; resolving a pairing alone (with the activity touch) is one commit too.
With several replicas on one PostgreSQL store, the session row is the serialisation point of a session:
recording a turn upserts it first (a row lock held to the commit), so two replicas recording turns of the
same session take consecutive turn indexes; a resolution is a conditional update (``pairing='awaiting'``),
so a turn is resolved once whichever replica gets there first; an idle sweep ends a session only if it is
still idle when its transaction runs, so exactly one replica closes it and a fresh turn is never cut off.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from engine.records import TURN_HISTORY_FIELDS, RejectReason, Turn, TurnRecord
from engine.records import SampleState as S
from policy_server.store.base import StoreDB, dump_json
from policy_server.store.connection import DB
from policy_server.store.records import SessionState
from policy_server.store.rows import session_state, turn_of
from policy_server.store.turn_records import pack


@dataclass(frozen=True)
class Resolution:
    """How an awaiting turn's pairing closes (see :meth:`StoreSessions.resolve_turn`), written with the next turn."""

    turn_index: int
    pairing: str
    next_state: list[dict[str, object]] | None
    note: str | None = None
    reject_reason: str | None = None


class StoreSessions(StoreDB):
    """Session and turn writes and reads (see the module docstring)."""

    def touch_session(self, session_id: str, now: float | None = None) -> None:
        """Create the session if new, reopen it if it was done, and refresh its activity time."""
        now = time.time() if now is None else now
        with self._tx() as db:
            _touch(db, session_id, now)

    def record_side_turn(
        self,
        session_id: str | None,
        rule: str,
        record: TurnRecord,
        now: float | None = None,
        *,
        redacted: list[str] | None = None,
    ) -> str:
        """Keep a side turn (served, never paired or trained) with the rule that made it side; returns its id.
        ``redacted``: the secret kinds already redacted out of ``record`` (policy_server.serving.secrets)."""
        now = time.time() if now is None else now
        side_id = f"side-{uuid.uuid4().hex}"
        with self._tx() as db:
            db.execute(
                "INSERT INTO side_turns (side_id, session_id, created_at, rule, record, redacted) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (side_id, session_id, now, rule, dump_json(record.to_json()), ",".join(redacted or []) or None),
            )
        return side_id

    def awaiting_turn(self, session_id: str) -> Turn | None:
        """The session's latest turn still waiting for its next state."""
        with self._read() as db:
            row = db.execute(
                "SELECT * FROM turns WHERE session_id=? AND pairing='awaiting' ORDER BY turn_index DESC LIMIT 1",
                (session_id,),
            ).fetchone()
            return turn_of(row, self.turn_records.whole(db, row)) if row else None

    def resolve_turn(
        self,
        session_id: str,
        resolution: Resolution,
        *,
        session_done: bool = False,
        now: float | None = None,
        touch: bool = False,
    ) -> str | None:
        """Close a turn's pairing as ``resolution`` says and create its sample (pending_judge, or rejected with
        the resolution's reason).

        ``touch`` also refreshes the session's activity time (and reopens it) in the same transaction.
        Returns the sample id, or None when the turn was already resolved (idempotent under races).
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            if touch:
                _touch(db, session_id, now)
            return _resolve(db, session_id, resolution, session_done=session_done, now=now)

    def record_turn(
        self,
        session_id: str,
        record: TurnRecord,
        *,
        session_done: bool,
        now: float | None = None,
        resolve: Resolution | None = None,
        redacted: list[str] | None = None,
    ) -> int:
        """Insert a main turn (its :class:`~engine.records.TurnRecord`) with the next turn index;
        returns that index. One transaction.

        ``resolve`` first closes the pairing of the turn this one answers (as :meth:`resolve_turn` would; a no-op
        when that turn was resolved meanwhile), in the same transaction: one commit per continuing turn.

        The session is created or reopened (a new main turn revives a session an idle sweep ended while
        the turn was generated). A turn still ``awaiting`` in the same session at this point was overtaken
        by a concurrent request of the same session: it can no longer be paired reliably and is rejected
        explicitly. With ``session_done`` the new turn is the session's last: resolved with no next state.
        ``redacted``: the secret kinds already redacted out of ``record``; such a turn's sample is rejected
        ``secret`` whenever its pairing closes (its token ids are not stored: they would encode the secret).
        """
        now = time.time() if now is None else now
        whole = record.to_json(share=TURN_HISTORY_FIELDS)  # the record's own lists: it is validated already
        # Stored as what it adds to the turn it answers when this process holds that turn's whole record
        # (policy_server.store.turn_records); otherwise whole, which is always correct.
        base = resolve.turn_index if resolve is not None and resolve.pairing == "paired" else None
        stored, record_base = (
            pack(whole, base, self.turn_records.cache.peek(session_id, base)) if base is not None else (whole, None)
        )
        with self._tx() as db:
            # Create/reopen the session, refresh its activity and take the next index in one statement (it also
            # row-locks the session until the commit: concurrent turns of the session, at any replica, queue here).
            idx = (
                db.execute(
                    "INSERT INTO sessions (session_id, last_activity, next_turn_index) VALUES (?, ?, 1) "
                    "ON CONFLICT(session_id) DO UPDATE SET last_activity=excluded.last_activity, done=0, "
                    "next_turn_index=sessions.next_turn_index+1 RETURNING next_turn_index",
                    (session_id, now),
                ).fetchone()[0]
                - 1
            )
            if resolve is not None:
                _resolve(db, session_id, resolve, session_done=False, now=now)
            db.execute(
                "INSERT INTO turns (session_id, turn_index, created_at, record, record_base, pairing, response_id, "
                "session_rule, session_decision, redacted) VALUES (?, ?, ?, ?, ?, 'awaiting', ?, ?, ?, ?)",
                (
                    session_id,
                    idx,
                    now,
                    dump_json(stored),
                    record_base,
                    record.response_id,
                    record.session_rule,
                    record.session_decision,
                    ",".join(redacted or []) or None,
                ),
            )
            older = db.execute(
                "SELECT turn_index FROM turns WHERE session_id=? AND pairing='awaiting' AND turn_index<?",
                (session_id, idx),
            ).fetchall()
            for (o,) in older:
                overtaken = Resolution(
                    o,
                    "mismatch",
                    None,
                    note="overtaken by a concurrent turn",
                    reject_reason=RejectReason.CONCURRENT_TURNS,
                )
                _resolve(db, session_id, overtaken, session_done=False, now=now)
            if session_done:
                _end(db, session_id, now)
        self.turn_records.cache.put(session_id, idx, whole)  # committed: the row's record from now on
        return idx

    def end_session(self, session_id: str, *, now: float | None = None, idle_before: float | None = None) -> list[str]:
        """Mark the session done; its awaiting turn becomes the last turn (no next state). One transaction.

        With ``idle_before`` (the idle sweep) the session is ended only if it is still open and its last
        activity is older than that when the transaction runs (under the session's row lock): a turn that
        arrived meanwhile, at any replica, keeps it open, and of several sweeping replicas one ends it."""
        now = time.time() if now is None else now
        with self._tx() as db:
            if idle_before is not None:
                row = db.execute(
                    "SELECT done, last_activity FROM sessions WHERE session_id=?" + self._for_update, (session_id,)
                ).fetchone()
                if row is None or row["done"] or row["last_activity"] >= idle_before:
                    return []
            return _end(db, session_id, now)

    def idle_sessions(self, idle_before: float) -> list[str]:
        with self._read() as db:
            rows = db.execute(
                "SELECT session_id FROM sessions WHERE done=0 AND last_activity<?", (idle_before,)
            ).fetchall()
        return [r[0] for r in rows]

    def get_turn(self, session_id: str, turn_index: int) -> Turn | None:
        """The stored turn (its whole record and its pairing columns), None when there is none."""
        with self._read() as db:
            row = db.execute(
                "SELECT * FROM turns WHERE session_id=? AND turn_index=?", (session_id, turn_index)
            ).fetchone()
            return turn_of(row, self.turn_records.whole(db, row)) if row else None

    def session(self, session_id: str) -> SessionState | None:
        """The session's row, None for a session never seen."""
        with self._read() as db:
            row = db.execute("SELECT * FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return session_state(row) if row else None


def _touch(db: DB, session_id: str, now: float) -> None:
    db.execute(
        "INSERT INTO sessions (session_id, last_activity) VALUES (?, ?) "
        "ON CONFLICT(session_id) DO UPDATE SET last_activity=excluded.last_activity, done=0",
        (session_id, now),
    )


def _resolve(db: DB, session_id: str, r: Resolution, *, session_done: bool, now: float) -> str | None:
    """Inside a transaction: see Store.resolve_turn."""
    row = db.execute(
        "UPDATE turns SET pairing=?, pairing_note=?, next_state=?, session_done=? "
        "WHERE session_id=? AND turn_index=? AND pairing='awaiting' RETURNING redacted",
        (r.pairing, r.note, dump_json(r.next_state), int(session_done), session_id, r.turn_index),
    ).fetchone()
    if row is None:
        return None
    reject_reason = r.reject_reason
    if row[0]:  # its token ids would encode a secret: never trained, whatever else is wrong with it
        reject_reason = RejectReason.with_detail(RejectReason.SECRET, row[0])
    if r.pairing == "mismatch":
        db.execute("UPDATE sessions SET mismatches=mismatches+1 WHERE session_id=?", (session_id,))
    sample_id = uuid.uuid4().hex
    status = S.REJECTED if reject_reason else S.PENDING_JUDGE
    db.execute(
        "INSERT INTO samples (sample_id, session_id, turn_index, status, reject_reason, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (sample_id, session_id, r.turn_index, status, reject_reason, now, now),
    )
    return sample_id


def _end(db: DB, session_id: str, now: float) -> list[str]:
    """Inside a transaction: see Store.end_session."""
    db.execute("UPDATE sessions SET done=1 WHERE session_id=?", (session_id,))
    rows = db.execute(
        "SELECT turn_index FROM turns WHERE session_id=? AND pairing='awaiting'", (session_id,)
    ).fetchall()
    out = []
    for (idx,) in rows:
        sid = _resolve(db, session_id, Resolution(idx, "session_end", None), session_done=True, now=now)
        if sid:
            out.append(sid)
    return out
