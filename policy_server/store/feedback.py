"""Explicit feedback on recorded turns: kept durably, applied to the turn's sample while it can still change.

Role (a Store role class): ``POST /v1/feedback`` (policy_server.api.feedback) writes here; the judge
dispatcher reads a turn's feedback when it judges the turn and settles what arrived meanwhile. The
decision itself is pure (policy_server.rewards.feedback); this module decides WHEN it applies:

- the turn has no sample yet or its sample is ``pending_judge``: the feedback is ``pending`` and the
  dispatcher applies it with the judge's outcome (:meth:`turn_feedback`, then :meth:`settle_feedback` for
  feedback that arrived while the judge ran);
- ``ready`` / ``pending_score`` / rejected for a reason about the reward signal: ``applied`` now, in the
  same transaction as the sample's new status and JSON (a sample that becomes ``ready`` wakes lease waiters);
- ``leased`` / ``consumed``: ``late`` (the trainer already has it; counted, never silently applied);
- any other state (refused for a defect of the turn itself, or an opd sample): ``recorded``.

The same ``idempotency_key`` twice is one feedback (the first answer is returned again); the key naming
another turn is a conflict. Every write is one transaction (policy_server.store.base).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from engine.records import SampleState as S
from policy_server.rewards.feedback import applicable, apply_feedback
from policy_server.store.base import StoreDB, dump_json

FEEDBACK_STATES = ("pending", "applied", "late", "recorded")


class FeedbackConflict(ValueError):
    """An idempotency key already used for feedback on another turn."""


class StoreFeedback(StoreDB):
    """Feedback rows and their application to samples (see the module docstring)."""

    def turn_by_response_id(self, response_id: str) -> tuple[str, int] | None:
        """The (session id, turn index) of the recorded turn that answered with ``response_id``."""
        with self._read() as db:
            row = db.execute("SELECT session_id, turn_index FROM turns WHERE response_id=?", (response_id,)).fetchone()
        return None if row is None else (row[0], int(row[1]))

    def add_feedback(
        self,
        session_id: str,
        turn_index: int,
        *,
        value: float,
        text: str | None,
        idempotency_key: str | None,
        policy: str,
        now: float | None = None,
    ) -> dict[str, Any] | None:
        """Record feedback on a turn and apply it if the turn's sample can still change; None when no such
        turn was recorded. Returns ``{"feedback_id", "session_id", "turn_index", "state", "duplicate",
        "sample_status"}``. Raises FeedbackConflict for a key already used on another turn."""
        now = time.time() if now is None else now
        became_ready = 0
        with self._tx() as db:
            if idempotency_key is not None:
                row = db.execute(
                    "SELECT feedback_id, session_id, turn_index, state FROM feedback WHERE idempotency_key=?",
                    (idempotency_key,),
                ).fetchone()
                if row is not None:
                    if (row["session_id"], int(row["turn_index"])) != (session_id, turn_index):
                        raise FeedbackConflict(
                            "idempotency_key was already used for feedback on another turn: use a new key"
                        )
                    return {**_answer(db, row), "duplicate": True}
            if not db.execute(
                "SELECT 1 FROM turns WHERE session_id=? AND turn_index=?", (session_id, turn_index)
            ).fetchone():
                return None
            feedback_id = f"fb-{uuid.uuid4().hex}"
            db.execute(
                "INSERT INTO feedback (feedback_id, session_id, turn_index, value, text, idempotency_key, state, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
                (feedback_id, session_id, turn_index, float(value), text, idempotency_key, now),
            )
            became_ready = self._settle(db, session_id, turn_index, policy, now)
            row = db.execute(
                "SELECT feedback_id, session_id, turn_index, state FROM feedback WHERE feedback_id=?", (feedback_id,)
            ).fetchone()
            out = {**_answer(db, row), "duplicate": False}
        self._ready_changed(became_ready)
        return out

    def turn_feedback(self, session_id: str, turn_index: int) -> dict[str, Any] | None:
        """The turn's feedback as it applies: ``{"value", "text", "count"}`` (the latest value, the latest
        non-empty text), or None when it has none."""
        with self._read() as db:
            return _latest(db, session_id, turn_index)

    def settle_feedback(self, session_id: str, turn_index: int, policy: str, now: float | None = None) -> str | None:
        """After the turn's judge outcome was written: apply (or mark late) its feedback still ``pending``.
        Returns the new state, None when nothing was pending."""
        now = time.time() if now is None else now
        with self._tx() as db:
            if not db.execute(
                "SELECT 1 FROM feedback WHERE session_id=? AND turn_index=? AND state='pending'",
                (session_id, turn_index),
            ).fetchone():
                return None
            became_ready = self._settle(db, session_id, turn_index, policy, now)
            state = db.execute(
                "SELECT state FROM feedback WHERE session_id=? AND turn_index=? ORDER BY created_at DESC LIMIT 1",
                (session_id, turn_index),
            ).fetchone()[0]
        self._ready_changed(became_ready)
        return str(state)

    def feedback_stats(self) -> dict[str, int]:
        """Feedback counts by state (every state listed) and in total."""
        out = dict.fromkeys(FEEDBACK_STATES, 0)
        with self._read() as db:
            for state, n in db.execute("SELECT state, COUNT(*) FROM feedback GROUP BY state"):
                out[state] = n
        out["total"] = sum(out.values())
        return out

    def list_feedback(self, session_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Feedback rows, newest first (the admin view): id, target, value, text, state, times."""
        where, args = ("WHERE session_id=? ", (session_id,)) if session_id is not None else ("", ())
        with self._read() as db:
            rows = db.execute(
                "SELECT feedback_id, session_id, turn_index, value, text, idempotency_key, state, created_at, "
                "applied_at FROM feedback " + where + "ORDER BY created_at DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [dict(r) for r in rows]

    def _settle(self, db: Any, session_id: str, turn_index: int, policy: str, now: float) -> int:
        """Inside a transaction: decide the turn's pending feedback against its sample's state now; returns
        1 when the sample became ready."""
        sample = db.execute(
            "SELECT sample_id, status, reject_reason, data FROM samples WHERE session_id=? AND turn_index=?"
            + self._for_update,
            (session_id, turn_index),
        ).fetchone()
        became_ready = 0
        if sample is None or sample["status"] == S.PENDING_JUDGE:
            return 0  # stays pending: the dispatcher applies it with the judge's outcome
        if sample["status"] in (S.LEASED, S.CONSUMED):
            state = "late"
        elif applicable(sample["status"], sample["reject_reason"]) and sample["data"]:
            fb = _latest(db, session_id, turn_index)
            assert fb is not None, "a pending feedback row exists"
            status, reason, data = apply_feedback(
                sample["status"],
                sample["reject_reason"],
                json.loads(sample["data"]),
                value=fb["value"],
                text=fb["text"],
                policy=policy,
                count=fb["count"],
            )
            db.execute(
                "UPDATE samples SET status=?, reject_reason=?, data=?, updated_at=? WHERE sample_id=? AND status=?",
                (status, reason, dump_json(data), now, sample["sample_id"], sample["status"]),
            )
            became_ready = int(status == S.READY and sample["status"] != S.READY)
            state = "applied"
        else:
            state = "recorded"
        db.execute(
            "UPDATE feedback SET state=?, applied_at=? WHERE session_id=? AND turn_index=? AND state='pending'",
            (state, now, session_id, turn_index),
        )
        return became_ready


def _latest(db: Any, session_id: str, turn_index: int) -> dict[str, Any] | None:
    rows = db.execute(
        "SELECT value, text FROM feedback WHERE session_id=? AND turn_index=? ORDER BY created_at, feedback_id",
        (session_id, turn_index),
    ).fetchall()
    if not rows:
        return None
    texts = [r["text"] for r in rows if r["text"]]
    return {"value": float(rows[-1]["value"]), "text": texts[-1] if texts else None, "count": len(rows)}


def _answer(db: Any, row: Any) -> dict[str, Any]:
    sample = db.execute(
        "SELECT status FROM samples WHERE session_id=? AND turn_index=?", (row["session_id"], row["turn_index"])
    ).fetchone()
    return {
        "feedback_id": row["feedback_id"],
        "session_id": row["session_id"],
        "turn_index": int(row["turn_index"]),
        "state": row["state"],
        "sample_status": None if sample is None else sample[0],
    }
