"""Read-only views of the store: stats, backlog and admin sample listings (a Store role class).

Role: what ``GET /v1/samples/stats``, ``GET /v1/samples`` and the main-turn backpressure check
(``unconsumed_backlog``, policy_server.serving.chat_turn) read. Nothing here changes state or takes a
transaction; each method takes the store lock for a consistent snapshot of its queries. Sample rows come back as
:class:`~policy_server.store.records.SampleRow` records with the Sample JSON decoded (``sample``; None before the
sample is judged). Statuses are those of policy_server.store (``SAMPLE_STATUSES``).
"""

from __future__ import annotations

from engine.records import UNCONSUMED_STATUSES, Turn
from engine.records import SampleState as S
from engine.validation import clip
from policy_server.store.base import SAMPLE_STATUSES, StoreDB
from policy_server.store.records import SampleRow, SideTurn, StoreCounts
from policy_server.store.rows import counts_by, listed_sample, side_turn, turn_of

# A sample row with its turn's pairing columns (rows.listed_sample reads it).
SAMPLE_WITH_TURN = (
    "SELECT s.sample_id, s.session_id, s.turn_index, s.status, s.reject_reason, s.attempts, s.last_error, "
    "s.created_at, s.updated_at, s.data, t.pairing, t.pairing_note, t.next_state, t.session_rule, "
    "t.session_decision FROM samples s "
    "LEFT JOIN turns t ON t.session_id=s.session_id AND t.turn_index=s.turn_index"
)
_COUNT_UNCONSUMED = f"SELECT COUNT(*) FROM samples WHERE status IN ({', '.join('?' * len(UNCONSUMED_STATUSES))})"


class StoreReads(StoreDB):
    """Counters and read-only sample views (see the module docstring)."""

    def stats(self) -> StoreCounts:
        with self._read() as db:
            by_status = counts_by(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status"), SAMPLE_STATUSES)
            reasons = counts_by(
                db.execute(
                    "SELECT reject_reason, COUNT(*) FROM samples WHERE status=? GROUP BY reject_reason", (S.REJECTED,)
                )
            )
            awaiting = db.execute("SELECT COUNT(*) FROM turns WHERE pairing='awaiting'").fetchone()[0]
            turns = db.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
            sessions = db.execute(
                "SELECT COUNT(*), SUM(CASE WHEN done=0 THEN 1 ELSE 0 END), SUM(mismatches) FROM sessions"
            ).fetchone()
            leases = db.execute("SELECT COUNT(*) FROM leases WHERE state='active'").fetchone()[0]
            retrying = db.execute(
                "SELECT COUNT(*) FROM samples WHERE status=? AND attempts>0", (S.PENDING_JUDGE,)
            ).fetchone()[0]
            score_retrying = db.execute(
                "SELECT COUNT(*) FROM samples WHERE status=? AND attempts>0", (S.PENDING_SCORE,)
            ).fetchone()[0]
            inferred = db.execute("SELECT COUNT(*) FROM sessions WHERE session_id LIKE 'inferred-%'").fetchone()[0]
            # Ended sessions whose every turn is decided and none included (all rejected: quarantined,
            # judge failures, no signal the at-least-one rule may promote): they gave the trainer nothing.
            without_sample = db.execute(
                "SELECT COUNT(*) FROM sessions x WHERE x.done=1 AND x.has_included=0 "
                "AND EXISTS (SELECT 1 FROM samples s WHERE s.session_id=x.session_id) "
                "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.session_id=x.session_id AND s.status=?)",
                (S.PENDING_JUDGE,),
            ).fetchone()[0]
            side = counts_by(db.execute("SELECT rule, COUNT(*) FROM side_turns GROUP BY rule"))
            rules = {
                f"{r}:{d}": int(n)
                for r, d, n in db.execute(
                    "SELECT session_rule, session_decision, COUNT(*) FROM turns "
                    "WHERE session_rule IS NOT NULL GROUP BY session_rule, session_decision"
                )
            }
        return StoreCounts(
            samples=by_status,
            reject_reasons=reasons,
            turns=int(turns),
            turns_awaiting_next_state=int(awaiting),
            sessions=int(sessions[0]),
            sessions_open=int(sessions[1] or 0),
            history_mismatches=int(sessions[2] or 0),
            active_leases=int(leases),
            pending_judge_retrying=int(retrying),
            pending_score_retrying=int(score_retrying),
            inferred_sessions=int(inferred),
            sessions_without_sample=int(without_sample),
            side_turns=side,
            turns_by_session_rule=rules,
        )

    def awaiting_open_turns(self, family: str | None = None) -> list[Turn]:
        """Awaiting turns of open sessions, oldest first: what session inference matches against.

        ``family``: only the sessions ``family`` and ``family~...`` (a client key's sessions,
        policy_server.serving.identity).
        """
        sql = (
            "SELECT t.* FROM turns t JOIN sessions s ON s.session_id=t.session_id "
            "WHERE s.done=0 AND t.pairing='awaiting'"
        )
        args: tuple[str | int, ...] = ()
        if family is not None:
            sql += " AND (t.session_id=? OR substr(t.session_id, 1, ?)=?)"
            args = (family, len(family) + 1, family + "~")
        with self._read() as db:
            rows = db.execute(sql + " ORDER BY t.created_at", args).fetchall()
            return [turn_of(r, self.turn_records.whole(db, r)) for r in rows]

    def open_family_sessions(self, family: str) -> list[str]:
        """Open sessions named ``family`` or ``family~...``, most recently active first."""
        with self._read() as db:
            rows = db.execute(
                "SELECT session_id FROM sessions WHERE done=0 AND (session_id=? OR substr(session_id, 1, ?)=?) "
                "ORDER BY last_activity DESC",
                (family, len(family) + 1, family + "~"),
            ).fetchall()
        return [r[0] for r in rows]

    def unconsumed_backlog(self) -> int:
        """Samples accepted but not yet consumed (awaiting pairing, judging, scoring, ready or leased)."""
        with self._read() as db:
            n = db.execute(_COUNT_UNCONSUMED, UNCONSUMED_STATUSES).fetchone()[0]
            a = db.execute("SELECT COUNT(*) FROM turns WHERE pairing='awaiting'").fetchone()[0]
        return int(n) + int(a)

    def list_samples(
        self, *, session_id: str | None = None, status: str | None = None, limit: int = 100
    ) -> list[SampleRow]:
        """Read-only view of sample rows (no lease, no state change), oldest first, with their Sample JSON.

        Each row: sample_id, session_id, turn_index, status, reject_reason, attempts, last_error,
        created_at, updated_at, ``sample`` (the Sample JSON once judged, else None) and ``turn``: the
        turn's ``pairing``, ``pairing_note`` and ``next_state`` (the messages typed by role that followed
        the reply, None until paired), so an operator sees why a sample was accepted or rejected.
        """
        if status is not None and status not in SAMPLE_STATUSES:
            raise ValueError(f"status must be one of {', '.join(SAMPLE_STATUSES)}, not {clip(status)}")
        where: list[str] = []
        args: list[str | int] = []
        if session_id is not None:
            where.append("s.session_id=?")
            args.append(session_id)
        if status is not None:
            where.append("s.status=?")
            args.append(status)
        sql = (
            SAMPLE_WITH_TURN
            + (" WHERE " + " AND ".join(where) if where else "")
            + (
                " ORDER BY s.turn_index"
                if session_id is not None
                else " ORDER BY s.created_at, s.session_id, s.turn_index"
            )
            + " LIMIT ?"
        )
        with self._read() as db:
            rows = db.execute(sql, (*args, int(limit))).fetchall()
        return [listed_sample(r) for r in rows]

    def list_side_turns(self, *, session_id: str | None = None, limit: int = 100) -> list[SideTurn]:
        """Side turns (served, never trained), newest first: ``side_id, session_id, created_at, rule`` and
        ``record`` (the turn's TurnRecord JSON, token-exact like a main turn's)."""
        where, args = ("WHERE session_id=? ", (session_id,)) if session_id is not None else ("", ())
        with self._read() as db:
            rows = db.execute(
                "SELECT side_id, session_id, created_at, rule, record FROM side_turns "
                + where
                + "ORDER BY created_at DESC LIMIT ?",
                (*args, int(limit)),
            ).fetchall()
        return [side_turn(r) for r in rows]
