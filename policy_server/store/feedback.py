"""Explicit feedback on recorded turns: kept durably, applied to the turn's sample while it can still change.

Role (a Store role class): ``POST /v1/feedback`` (policy_server.api.feedback) writes here; the judge
dispatcher reads a turn's feedback when it judges the turn and settles what arrived meanwhile. The
decision itself is pure (policy_server.store.feedback_rule); this module decides WHEN it applies:

- the turn has no sample yet or its sample is ``pending_judge``: the feedback is ``pending`` and the
  dispatcher applies it with the judge's outcome (:meth:`turn_feedback`, then :meth:`settle_feedback` for
  feedback that arrived while the judge ran);
- ``ready`` / ``pending_score`` / rejected for a reason about the reward signal: ``applied`` now, in the
  same transaction as the sample's new status and JSON (a sample that becomes ``ready`` wakes lease waiters);
- ``leased`` / ``consumed``: ``late`` (the trainer already has it; counted, never silently applied);
- any other state (refused for a defect of the turn itself, or an opd sample), or a sample whose text retention
  purged (policy_server.store.retention): ``recorded``; feedback on a turn retention purged keeps no text.

Settling a feedback also records the sign of the judge's PRM verdict on its turn (``judge_sign``) whatever the
sample's state, and keeps the at-least-one rule: feedback that makes a sample included marks its session as
having one; feedback that excludes a session's last included sample re-runs the rule, in the same
transaction (the session row is locked after the sample's, so concurrent feedback on one session is serialised):
the earliest promotable turn (policy_server.store.feedback_rule.promotable) becomes ``ready`` with reward 0.0;
without one, the session's flag is cleared so the dispatcher promotes the next neutral turn it judges.
Leased and consumed samples are never changed, and count as included.

:meth:`judge_agreement` reads the judge/feedback agreement (:class:`JudgeAgreement`): the latest
``window`` turns with a feedback and a verdict, newest feedback first (one index range, see the migration
"feedback judge sign"), and every paired feedback ever (one scan of the feedback rows).

The same ``idempotency_key`` twice is one feedback (the first answer is returned again); the key naming
another turn is a conflict. Every write is one transaction (policy_server.store.base).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from engine.records import SampleState as S
from policy_server.store.base import StoreDB, dump_json
from policy_server.store.connection import DB, DBRow
from policy_server.store.feedback_rule import (
    PROMOTABLE,
    applicable,
    apply_feedback,
    judge_sign,
    promotable,
    promote,
    value_sign,
)
from policy_server.store.records import FeedbackAnswer, FeedbackCounts, FeedbackRow, TurnFeedback
from policy_server.store.retention import PURGED
from policy_server.store.rows import counts_by, feedback_row

logger = logging.getLogger(__name__)

FEEDBACK_STATES = ("pending", "applied", "late", "recorded")
SIGNS = (1, 0, -1)
# Samples that count for the at-least-one rule: trainable now, held for a session score, or already trained on.
_INCLUDED = (S.READY, S.PENDING_SCORE, S.LEASED, S.CONSUMED)


@dataclass(frozen=True)
class SignCounts:
    """Agreement pairs by (judge verdict sign, feedback sign): ``cells`` holds all nine, SIGNS order."""

    cells: tuple[tuple[int, int, int], ...]  # (verdict sign, feedback sign, pairs)

    @classmethod
    def of(cls, counts: Mapping[tuple[int, int], int]) -> SignCounts:
        return cls(tuple((v, f, counts.get((v, f), 0)) for v in SIGNS for f in SIGNS))

    @property
    def pairs(self) -> int:
        return sum(n for _, _, n in self.cells)

    @property
    def agree(self) -> int:
        """Pairs of equal signs (a neutral verdict against a neutral feedback agrees)."""
        return sum(n for v, f, n in self.cells if v == f)

    @property
    def share(self) -> float | None:
        """Agreeing share of the pairs, None when there are none."""
        return self.agree / self.pairs if self.pairs else None


@dataclass(frozen=True)
class JudgeAgreement:
    """The judge/feedback agreement read from the store.

    ``window``: the latest ``window_size`` turns whose feedback met a PRM verdict, each counted once with its
    latest feedback; ``total``: every feedback ever settled against a verdict (a changed mind counts again)."""

    window_size: int
    window: SignCounts
    total: SignCounts


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
        at_least_one: bool = True,
        now: float | None = None,
    ) -> FeedbackAnswer | None:
        """Record feedback on a turn and apply it if the turn's sample can still change; None when no such
        turn was recorded. ``at_least_one``: the rule is on (re-run when this feedback excludes the session's
        last included sample). Raises FeedbackConflict for a key already used on another turn."""
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
                    return _answer(db, row, duplicate=True)
            turn = db.execute(
                "SELECT record FROM turns WHERE session_id=? AND turn_index=?", (session_id, turn_index)
            ).fetchone()
            if turn is None:
                return None
            if turn[0] == PURGED:
                text = None  # retention purged the session's text: it is never trained, so nothing new is kept
            feedback_id = f"fb-{uuid.uuid4().hex}"
            db.execute(
                "INSERT INTO feedback (feedback_id, session_id, turn_index, value, text, idempotency_key, state, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
                (feedback_id, session_id, turn_index, float(value), text, idempotency_key, now),
            )
            became_ready = self._settle(db, session_id, turn_index, policy, at_least_one, now)
            row = db.execute(
                "SELECT feedback_id, session_id, turn_index, state FROM feedback WHERE feedback_id=?", (feedback_id,)
            ).fetchone()
            out = _answer(db, row, duplicate=False)
        self._ready_changed(became_ready)
        return out

    def turn_feedback(self, session_id: str, turn_index: int) -> TurnFeedback | None:
        """The turn's feedback as it applies (the latest value, the latest non-empty text, the count), or None
        when it has none."""
        with self._read() as db:
            return _latest(db, session_id, turn_index)

    def settle_feedback(
        self, session_id: str, turn_index: int, policy: str, at_least_one: bool = True, now: float | None = None
    ) -> str | None:
        """After the turn's judge outcome was written: apply (or mark late) its feedback still ``pending``
        (``at_least_one`` as in :meth:`add_feedback`). Returns the new state, None when nothing was pending."""
        now = time.time() if now is None else now
        with self._tx() as db:
            if not db.execute(
                "SELECT 1 FROM feedback WHERE session_id=? AND turn_index=? AND state='pending'",
                (session_id, turn_index),
            ).fetchone():
                return None
            became_ready = self._settle(db, session_id, turn_index, policy, at_least_one, now)
            state = db.execute(
                "SELECT state FROM feedback WHERE session_id=? AND turn_index=? ORDER BY created_at DESC LIMIT 1",
                (session_id, turn_index),
            ).fetchone()[0]
        self._ready_changed(became_ready)
        return str(state)

    def feedback_stats(self) -> FeedbackCounts:
        """Feedback counts by state (every state listed) and in total."""
        with self._read() as db:
            out = counts_by(db.execute("SELECT state, COUNT(*) FROM feedback GROUP BY state"), FEEDBACK_STATES)
        return FeedbackCounts(**out, total=sum(out.values()))

    def judge_agreement(self, window: int) -> JudgeAgreement:
        """The judge/feedback agreement over the latest ``window`` paired turns and over all feedback."""
        with self._read() as db:
            latest = db.execute(
                "SELECT f.judge_sign, f.value FROM feedback f WHERE f.judge_sign IS NOT NULL AND NOT EXISTS "
                "(SELECT 1 FROM feedback g WHERE g.session_id=f.session_id AND g.turn_index=f.turn_index AND "
                "(g.created_at>f.created_at OR (g.created_at=f.created_at AND g.feedback_id>f.feedback_id))) "
                "ORDER BY f.created_at DESC, f.feedback_id DESC LIMIT ?",
                (window,),
            ).fetchall()
            totals = db.execute(
                "SELECT judge_sign, CASE WHEN value>0 THEN 1 WHEN value<0 THEN -1 ELSE 0 END AS value_sign, "
                "COUNT(*) FROM feedback WHERE judge_sign IS NOT NULL GROUP BY judge_sign, value_sign"
            ).fetchall()
        return JudgeAgreement(
            window_size=window,
            window=SignCounts.of(Counter((int(v), value_sign(x)) for v, x in latest)),
            total=SignCounts.of({(int(v), int(f)): int(n) for v, f, n in totals}),
        )

    def list_feedback(self, session_id: str | None = None, limit: int = 100) -> list[FeedbackRow]:
        """Feedback rows, newest first (the admin view): id, target, value, text, state, times, and the sign
        of the judge's verdict on the turn (``judge_sign``, None while not judged or without a verdict)."""
        where, args = ("WHERE session_id=? ", (session_id,)) if session_id is not None else ("", ())
        with self._read() as db:
            rows = db.execute(
                "SELECT feedback_id, session_id, turn_index, value, text, idempotency_key, state, created_at, "
                "applied_at, judge_sign FROM feedback " + where + "ORDER BY created_at DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [feedback_row(r) for r in rows]

    def _settle(self, db: DB, session_id: str, turn_index: int, policy: str, at_least_one: bool, now: float) -> int:
        """Inside a transaction: decide the turn's pending feedback against its sample's state now, keep the
        at-least-one rule (module docstring); returns how many samples became ready."""
        sample = db.execute(
            "SELECT sample_id, status, reject_reason, data FROM samples WHERE session_id=? AND turn_index=?"
            + self._for_update,
            (session_id, turn_index),
        ).fetchone()
        if sample is None or sample["status"] == S.PENDING_JUDGE:
            return 0  # stays pending: the dispatcher applies it with the judge's outcome
        # Then the session row (the sample -> session lock order of complete_judge, so neither waits on the
        # other in a cycle): settles of one session queue here, so two feedbacks that each exclude one of its
        # samples cannot both see the other's sample as still included.
        db.execute("SELECT has_included FROM sessions WHERE session_id=?" + self._for_update, (session_id,))
        data = json.loads(sample["data"]) if sample["data"] else None
        was_included, now_included = sample["status"] in _INCLUDED, sample["status"] in _INCLUDED
        became_ready = 0
        if sample["status"] in (S.LEASED, S.CONSUMED):
            state = "late"
        elif applicable(sample["status"], sample["reject_reason"]) and data:
            fb = _latest(db, session_id, turn_index)
            assert fb is not None, "a pending feedback row exists"
            status, reason, out = apply_feedback(
                sample["status"],
                sample["reject_reason"],
                data,
                value=fb.value,
                text=fb.text,
                policy=policy,
                count=fb.count,
            )
            db.execute(
                "UPDATE samples SET status=?, reject_reason=?, data=?, updated_at=? WHERE sample_id=? AND status=?",
                (status, reason, dump_json(out), now, sample["sample_id"], sample["status"]),
            )
            became_ready = int(status == S.READY and sample["status"] != S.READY)
            now_included = status in _INCLUDED
            state = "applied"
        else:
            state = "recorded"
        db.execute(
            "UPDATE feedback SET state=?, applied_at=?, judge_sign=? "
            "WHERE session_id=? AND turn_index=? AND state='pending'",
            (state, now, judge_sign((data or {}).get("prm")), session_id, turn_index),
        )
        if now_included and not was_included:
            db.execute("UPDATE sessions SET has_included=1 WHERE session_id=?", (session_id,))
        elif was_included and not now_included:
            became_ready += self._rerun_at_least_one(db, session_id, at_least_one, now)
        return became_ready

    def _rerun_at_least_one(self, db: DB, session_id: str, at_least_one: bool, now: float) -> int:
        """Inside :meth:`_settle`, after feedback excluded an included sample: when the session has none left,
        include its earliest promotable turn (the one judging in turn order would have promoted) and set the
        session's flag to whether one was; returns 1 when a sample became ready."""
        marks = ", ".join("?" for _ in _INCLUDED)
        if db.execute(
            f"SELECT 1 FROM samples WHERE session_id=? AND status IN ({marks}) LIMIT 1", (session_id, *_INCLUDED)
        ).fetchone():
            return 0
        promoted = 0
        if at_least_one:
            rejected = db.execute(
                "SELECT sample_id, turn_index, reject_reason FROM samples WHERE session_id=? AND status=? "
                "ORDER BY turn_index",
                (session_id, S.REJECTED),
            ).fetchall()
            for row in rejected:
                if (row["reject_reason"] or "").split(":", 1)[0] not in PROMOTABLE:
                    continue  # decided by its reason alone: only candidates' JSON is read
                # SKIP LOCKED: a candidate locked by feedback on it right now is that feedback's to decide
                # (waiting for it while holding the session row could close a lock cycle with it).
                found = db.execute(
                    "SELECT data FROM samples WHERE sample_id=? AND status=?" + self._skip_locked,
                    (row["sample_id"], S.REJECTED),
                ).fetchone()
                data = json.loads(found["data"]) if found is not None and found["data"] else None
                if data is None or not promotable(row["reject_reason"], data):
                    continue
                db.execute(
                    "UPDATE samples SET status=?, reject_reason=NULL, data=?, updated_at=? WHERE sample_id=?",
                    (S.READY, dump_json(promote(data)), now, row["sample_id"]),
                )
                logger.info("at-least-one after feedback: promoting neutral turn %s/%s", session_id, row["turn_index"])
                promoted = 1
                break
        db.execute("UPDATE sessions SET has_included=? WHERE session_id=?", (promoted, session_id))
        return promoted


def _latest(db: DB, session_id: str, turn_index: int) -> TurnFeedback | None:
    rows = db.execute(
        "SELECT value, text FROM feedback WHERE session_id=? AND turn_index=? ORDER BY created_at, feedback_id",
        (session_id, turn_index),
    ).fetchall()
    if not rows:
        return None
    texts = [r["text"] for r in rows if r["text"]]
    return TurnFeedback(value=float(rows[-1]["value"]), text=texts[-1] if texts else None, count=len(rows))


def _answer(db: DB, row: DBRow, *, duplicate: bool) -> FeedbackAnswer:
    sample = db.execute(
        "SELECT status FROM samples WHERE session_id=? AND turn_index=?", (row["session_id"], row["turn_index"])
    ).fetchone()
    return FeedbackAnswer(
        feedback_id=row["feedback_id"],
        session_id=row["session_id"],
        turn_index=int(row["turn_index"]),
        state=row["state"],
        sample_status=None if sample is None else sample[0],
        duplicate=duplicate,
    )
