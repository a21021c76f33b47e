"""Session pins and their rewards (a Store role class): which weight version serves each session, and what the
canary test counts per version.

Session pins (safe updates): :meth:`pin_session` records, once, the version a session's first turn was served
by; every replica then routes the session's turns to that version while it is served. :meth:`session_rewards`
reads what the canary test counts: per finished, fully judged session of a version, the mean of its turns'
judge verdicts (the stored PRM verdict: its score when ok, 0 for a tie) and its explicit feedback values. A
session with a turn sampled by another version (it outlived its version) is not counted.
"""

from __future__ import annotations

import time

from engine.records import SessionReward
from policy_server.store.base import StoreDB
from policy_server.store.rows import sample_signals


class StoreSessionPins(StoreDB):
    def pin_session(self, session_id: str, version: str) -> str:
        """The version ``session_id`` is pinned to: ``version`` when the session had no pin yet (one transaction;
        of two replicas pinning at once the first wins and both get its pin)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO session_pins (session_id, version, pinned_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                (session_id, version, time.time()),
            )
            row = db.execute("SELECT version FROM session_pins WHERE session_id=?", (session_id,)).fetchone()
        return str(row[0])

    def session_pin(self, session_id: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT version FROM session_pins WHERE session_id=?", (session_id,)).fetchone()
        return None if row is None else str(row[0])

    def open_pinned_sessions(self, version: str, active_since: float) -> int:
        """Sessions pinned to ``version`` that are not done and were active after ``active_since`` (a session whose
        first turn is still being generated has a pin and no row yet: it counts as open)."""
        with self._read() as db:
            row = db.execute(
                "SELECT COUNT(*) FROM session_pins p LEFT JOIN sessions x ON x.session_id = p.session_id "
                "WHERE p.version=? AND (x.session_id IS NULL OR x.done=0) "
                "AND COALESCE(x.last_activity, p.pinned_at) >= ?",
                (version, active_since),
            ).fetchone()
        return int(row[0])

    def session_rewards(
        self, version: str, *, since: float = 0.0, before: float | None = None, limit: int = 10_000
    ) -> list[SessionReward]:
        """The newest ``limit`` finished sessions pinned to ``version`` between ``since`` and ``before`` (pin
        times) whose turns are all judged and all sampled by ``version``, with at least one reward signal."""
        with self._read() as db:
            pins = db.execute(
                "SELECT p.session_id, p.pinned_at FROM session_pins p JOIN sessions x ON x.session_id = p.session_id "
                "WHERE p.version=? AND p.pinned_at >= ? AND p.pinned_at < ? AND x.done=1 "
                "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.session_id = p.session_id "
                "AND s.status IN ('pending_judge', 'pending_score')) "
                "ORDER BY p.pinned_at DESC LIMIT ?",
                (version, since, before if before is not None else 1e300, limit),
            ).fetchall()
            out = []
            for pin in pins:
                sid = pin["session_id"]
                rows = db.execute("SELECT data FROM samples WHERE session_id=?", (sid,)).fetchall()
                values: list[float] = []
                mixed = False
                for r in rows:
                    versions, j = sample_signals(r["data"])
                    mixed = mixed or bool(versions - {version})
                    if j is not None:
                        values.append(j)
                feedback = db.execute("SELECT value FROM feedback WHERE session_id=?", (sid,)).fetchall()
                values += [float(f[0]) for f in feedback]
                if mixed or not values:
                    continue
                reward = max(-1.0, min(1.0, sum(values) / len(values)))
                out.append(
                    SessionReward(
                        session_id=sid, version=version, reward=reward, signals=len(values), pinned_at=pin["pinned_at"]
                    )
                )
        return out
