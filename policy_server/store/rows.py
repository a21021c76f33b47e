"""Row mapping: where a row becomes the record the store hands out, and where a record's JSON becomes a row's.

Role: the store's public methods take and return records (engine.records, and the store's own:
policy_server.store.records); the JSON of a row is built here and read into its record here, so the role classes
(sessions, samples, leases, reads, responses, feedback) never hand a row dict out.

A turn's JSON is its whole :class:`~engine.records.TurnRecord` (the ``record`` column, or the whole record
rebuilt by policy_server.store.turn_records) plus its columns, in ``Turn``'s field order; the record is
validated as it is read (a row that breaks the schema fails loudly, never half-read).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from engine import fastjson
from engine.records import TURN_HISTORY_FIELDS, Turn
from policy_server.store.connection import DBRow
from policy_server.store.feedback_rule import judge_reward
from policy_server.store.records import (
    FeedbackRow,
    JudgeJob,
    SampleRow,
    SampleTurn,
    SessionState,
    SideTurn,
)


# ---------------------------------------------------------------------------- turns
def turn_dict(row: DBRow, record: dict[str, object] | None = None) -> dict[str, object]:
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


def turn_of(row: DBRow, record: dict[str, object] | None = None) -> Turn:
    """A ``turns`` row as its :class:`~engine.records.Turn` (see :func:`turn_dict`); ``to_json()`` gives the
    same JSON back, key for key.

    Without ``record`` the row's own ``record`` column is read and validated whole. A given ``record`` is one
    policy_server.store.turn_records handed out, validated as a :class:`~engine.records.TurnRecord` already
    (when it was recorded, or when it was read from the database): the row's columns and the record's other
    fields are validated here, and its messages and prompt ids, which grow with the history, are not walked
    again; the turn shares those two lists with ``record`` (neither side changes them)."""
    if record is None:
        return Turn.model_validate(turn_dict(row))
    history = {k: record[k] for k in TURN_HISTORY_FIELDS if k in record}
    turn = Turn.model_validate(turn_dict(row, {**record, **dict.fromkeys(history, [])}))
    return turn.model_copy(update=history) if history else turn


# ---------------------------------------------------------------------------- judge work and sessions
def judge_job(row: DBRow) -> JudgeJob:
    """A ``samples`` row (sample_id, session_id, turn_index, attempts) as its :class:`JudgeJob`."""
    return JudgeJob(row["sample_id"], row["session_id"], int(row["turn_index"]), int(row["attempts"]))


def session_state(row: DBRow) -> SessionState:
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


# ---------------------------------------------------------------------------- row mapping of the reads
def sample_row(row: DBRow, turn: SampleTurn) -> SampleRow:
    """A ``samples`` row (its columns, ``data`` the Sample JSON text) and its turn as its :class:`SampleRow`."""
    return SampleRow(
        sample_id=row["sample_id"],
        session_id=row["session_id"],
        turn_index=int(row["turn_index"]),
        status=row["status"],
        reject_reason=row["reject_reason"],
        attempts=int(row["attempts"]),
        last_error=row["last_error"],
        created_at=float(row["created_at"]),
        updated_at=float(row["updated_at"]),
        sample=json.loads(row["data"]) if row["data"] else None,
        turn=turn,
    )


def listed_sample(row: DBRow) -> SampleRow:
    """A ``samples`` row joined with its turn's pairing columns (:data:`SAMPLE_WITH_TURN`) as its record."""
    return sample_row(
        row,
        SampleTurn(
            pairing=row["pairing"],
            pairing_note=row["pairing_note"],
            next_state=json.loads(row["next_state"]) if row["next_state"] else None,
            session_rule=row["session_rule"],
            session_decision=row["session_decision"],
        ),
    )


def sample_turn(turn: Turn) -> SampleTurn:
    """The pairing columns of a stored turn, as a sample row shows them."""
    return SampleTurn(
        pairing=turn.pairing,
        pairing_note=turn.pairing_note,
        next_state=turn.next_state,
        session_rule=turn.session_rule,
        session_decision=turn.session_decision,
    )


def side_turn(row: DBRow) -> SideTurn:
    """A ``side_turns`` row as its :class:`SideTurn` (the record JSON decoded)."""
    return SideTurn(
        side_id=row["side_id"],
        session_id=row["session_id"],
        created_at=float(row["created_at"]),
        rule=row["rule"],
        record=json.loads(row["record"]),
    )


def feedback_row(row: DBRow) -> FeedbackRow:
    """A ``feedback`` row as its :class:`FeedbackRow`."""
    return FeedbackRow(
        feedback_id=row["feedback_id"],
        session_id=row["session_id"],
        turn_index=int(row["turn_index"]),
        value=float(row["value"]),
        text=row["text"],
        idempotency_key=row["idempotency_key"],
        state=row["state"],
        created_at=float(row["created_at"]),
        applied_at=None if row["applied_at"] is None else float(row["applied_at"]),
        judge_sign=None if row["judge_sign"] is None else int(row["judge_sign"]),
    )


def counts_by(rows: Iterable[DBRow], keys: tuple[str, ...] = ()) -> dict[str, int]:
    """``(key, count)`` rows as a mapping, every one of ``keys`` listed (0 when absent)."""
    out = dict.fromkeys(keys, 0)
    for key, n in rows:
        out[key] = int(n)
    return out


def messages_json(messages: list[dict[str, object]]) -> str:
    """The JSON text a list of chat messages is stored as."""
    return json.dumps(messages, ensure_ascii=False)


def messages_of(text: str) -> list[dict[str, object]]:
    """Stored chat messages read back from their JSON text."""
    messages: list[dict[str, object]] = json.loads(text)
    return messages


def sample_signals(data: str | None) -> tuple[set[str], float | None]:
    """A sample's JSON read for the canary test: the weight versions that sampled its tokens, and the reward its
    stored PRM verdict gives (policy_server.store.feedback_rule.judge_reward; None when it gives none)."""
    sample = json.loads(data) if data else {}
    versions = {sample.get("weight_version"), *(sample.get("weight_versions") or [])} - {None}
    return {str(v) for v in versions}, judge_reward(sample.get("prm"))
