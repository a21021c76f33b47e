"""Row mapping: where a row becomes the record the store hands out, and the records of the store's edge.

Role: the store's public methods take and return records (engine.records, and the store's own below: acks,
sample and side-turn rows, counters, feedback answers and rows, stored conversations, trajectories, scoring
outcomes); the JSON of a row is built here and read into its record here, so the role classes (sessions,
samples, leases, reads, responses, feedback) never hand a row dict out. A record that is also an HTTP body as it
is (an ack, a sample row) is closed and constrained like one: policy_server.api.response_models uses it as such.
The connection the role classes use is typed here too (:class:`DB`, :class:`Cursor`, :class:`DBRow`).

A turn's JSON is its whole :class:`~engine.records.TurnRecord` (the ``record`` column, or the whole record
rebuilt by policy_server.store.turn_records) plus its columns, in ``Turn``'s field order; the record is
validated as it is read (a row that breaks the schema fails loudly, never half-read).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from engine import fastjson
from engine.records import Sample, Turn


# ---------------------------------------------------------------------------- the connection the role classes use
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
    same JSON back, key for key."""
    return Turn.model_validate(turn_dict(row, record))


@dataclass(frozen=True)
class JudgeJob:
    """A ``pending_judge`` sample waiting for the dispatcher: its row id, its turn, and the tries so far."""

    sample_id: str
    session_id: str
    turn_index: int
    attempts: int


def judge_job(row: DBRow) -> JudgeJob:
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


@dataclass(frozen=True)
class TurnFeedback:
    """A turn's explicit feedback as it applies: the latest value, the latest non-empty text, how many."""

    value: float
    text: str | None
    count: int


# ---------------------------------------------------------------------------- records of the store's reads
class StoreRecord(BaseModel):
    """A record the store hands out; closed, as its JSON is also an HTTP body (policy_server.api.response_models)."""

    model_config = ConfigDict(extra="forbid")


class AckResult(StoreRecord):
    """The answer of an ack: how many samples it consumed, or ``already_acked`` for a second ack (0 consumed)."""

    lease_id: str
    acked: int = Field(..., ge=0)
    already_acked: bool
    revoked: list[str] = []  # samples whose session was deleted while leased: dropped, never consumed


class SampleTurn(StoreRecord):
    """A sample row's turn: its pairing, the messages that followed the reply, and the session rule."""

    pairing: str | None
    pairing_note: str | None
    next_state: list[dict[str, object]] | None
    session_rule: str | None
    session_decision: str | None


class SampleRow(StoreRecord):
    """A ``samples`` row as the read-only view shows it; ``sample`` is the Sample JSON as stored (None before
    judging), kept as written so a row off the schema is still shown, not hidden by a failed read."""

    sample_id: str
    session_id: str
    turn_index: int = Field(..., ge=0)
    status: str
    reject_reason: str | None
    attempts: int = Field(..., ge=0)
    last_error: str | None
    created_at: float
    updated_at: float
    sample: dict[str, object] | None
    turn: SampleTurn


class SideTurn(StoreRecord):
    """A side turn (served, never trained): the rule that made it side and its TurnRecord JSON."""

    side_id: str
    session_id: str | None
    created_at: float
    rule: str
    record: dict[str, object]


class StoreCounts(StoreRecord):
    """The store's counters (``GET /v1/samples/stats`` before the server adds its own)."""

    samples: dict[str, int]
    reject_reasons: dict[str, int]
    turns: int = Field(..., ge=0)
    turns_awaiting_next_state: int = Field(..., ge=0)
    sessions: int = Field(..., ge=0)
    sessions_open: int = Field(..., ge=0)
    history_mismatches: int = Field(..., ge=0)
    active_leases: int = Field(..., ge=0)
    pending_judge_retrying: int = Field(..., ge=0)
    pending_score_retrying: int = Field(..., ge=0)
    inferred_sessions: int = Field(..., ge=0)
    # ended sessions, every turn decided, none included: at-least-one found nothing trainable to promote
    sessions_without_sample: int = Field(..., ge=0)
    side_turns: dict[str, int]
    turns_by_session_rule: dict[str, int]


class FeedbackCounts(StoreRecord):
    """Feedback counts by state, every state listed, and in total."""

    pending: int = Field(..., ge=0)
    applied: int = Field(..., ge=0)
    late: int = Field(..., ge=0)
    recorded: int = Field(..., ge=0)
    total: int = Field(..., ge=0)


class FeedbackAnswer(StoreRecord):
    """What recording a feedback did: its id and target, its state, the sample's status, and whether the
    idempotency key made it a repeat of an earlier one (``duplicate``: that one's answer)."""

    feedback_id: str
    session_id: str
    turn_index: int = Field(..., ge=0)
    state: str
    sample_status: str | None
    duplicate: bool


class FeedbackRow(StoreRecord):
    """A ``feedback`` row (the admin view)."""

    feedback_id: str
    session_id: str
    turn_index: int = Field(..., ge=0)
    value: float
    text: str | None
    idempotency_key: str | None
    state: str
    created_at: float
    applied_at: float | None
    judge_sign: int | None = Field(
        None, ge=-1, le=1, description="sign of the turn's PRM verdict once settled; null without one"
    )


class StoredConversation(StoreRecord):
    """A stored Responses answer's whole conversation (its chain's messages, oldest first) and its session."""

    session_id: str | None
    conversation: list[dict[str, object]]


@dataclass(frozen=True)
class StoredResponse:
    """What one Responses answer added to its conversation (written once): its id, session, the answer it
    continued (None: it started the conversation) and its new messages in the chat shape."""

    response_id: str
    session_id: str | None
    previous_id: str | None
    messages: list[dict[str, object]]


@dataclass(frozen=True)
class TrajectoryTurn:
    """One turn of a session trajectory (``session_trajectory``): the turn, and its sample row (None while the
    turn awaits its next state) with the stored Sample JSON."""

    turn: Turn
    sample: SampleRow | None


@dataclass(frozen=True)
class ScoredSample:
    """A held sample's scoring outcome for ``complete_score``: ``ready`` or ``rejected``, and its Sample."""

    sample_id: str
    status: str
    reject_reason: str | None
    sample: Sample


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
