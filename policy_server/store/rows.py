"""Row mapping: where a ``turns`` row becomes the :class:`~engine.records.Turn` record the store hands out.

Role: the store's public methods take and return records (engine.records); the JSON of a row is built here
and read into its record here, so the role classes (sessions, samples, reads) never hand a row dict out.
A turn's JSON is its whole :class:`~engine.records.TurnRecord` (the ``record`` column, or the whole record
rebuilt by policy_server.store.turn_records) plus its columns, in ``Turn``'s field order; the record is
validated as it is read (a row that breaks the schema fails loudly, never half-read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine import fastjson
from engine.records import Turn


def turn_dict(row: Any, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``turns`` row as the :class:`~engine.records.Turn` JSON: the turn's whole record (``TurnRecord``;
    ``record``, else the row's own ``record`` column) plus its session, index and pairing columns (``Turn``'s
    own fields, in their order). A given ``record`` is copied, not changed."""
    rec = dict(record) if record is not None else fastjson.loads(row["record"])
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


def turn_of(row: Any, record: dict[str, Any] | None = None) -> Turn:
    """A ``turns`` row as its :class:`~engine.records.Turn` (see :func:`turn_dict`); ``to_json()`` gives the
    same JSON back, key for key."""
    return Turn.model_validate(turn_dict(row, record))


@dataclass(frozen=True)
class JudgeJob:
    """A ``pending_judge`` sample waiting for the dispatcher: its row id, its turn, and the tries so far."""

    sample_id: str
    session_id: str
    turn_index: int
    attempts: int


def judge_job(row: Any) -> JudgeJob:
    """A ``samples`` row (sample_id, session_id, turn_index, attempts) as its :class:`JudgeJob`."""
    return JudgeJob(row["sample_id"], row["session_id"], int(row["turn_index"]), int(row["attempts"]))


@dataclass(frozen=True)
class SessionState:
    """A ``sessions`` row: the next turn index, last activity, whether the session is done and already has an
    included sample (the at-least-one rule), its history mismatches, and which replica claims its work until
    when (None: unclaimed)."""

    session_id: str
    next_turn_index: int
    last_activity: float
    done: bool
    has_included: bool
    mismatches: int
    claimed_by: str | None
    claim_expires_at: float | None


def session_state(row: Any) -> SessionState:
    """A ``sessions`` row as its :class:`SessionState` (the integer flags as booleans)."""
    return SessionState(
        session_id=row["session_id"],
        next_turn_index=int(row["next_turn_index"]),
        last_activity=float(row["last_activity"]),
        done=bool(row["done"]),
        has_included=bool(row["has_included"]),
        mismatches=int(row["mismatches"]),
        claimed_by=row["claimed_by"],
        claim_expires_at=None if row["claim_expires_at"] is None else float(row["claim_expires_at"]),
    )


@dataclass(frozen=True)
class TurnFeedback:
    """A turn's explicit feedback as it applies: the latest value, the latest non-empty text, how many."""

    value: float
    text: str | None
    count: int
