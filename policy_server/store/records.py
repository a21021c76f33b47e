"""The records of the store's edge: what the store's public methods take and return besides engine.records.

Role: the typed answers of the role classes (acks, sample and side-turn rows, counters, feedback answers and rows,
stored conversations and Responses answers, trajectories, scoring outcomes, judge jobs, session states). A record
that is also an HTTP body as it is (an ack, a sample row) is a closed :class:`StoreRecord`, constrained like one:
policy_server.api.response_models uses it as such. A row becomes its record in policy_server.store.rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from engine.records import Sample, Turn


# ---------------------------------------------------------------------------- records of the store's work
@dataclass(frozen=True)
class JudgeJob:
    """A ``pending_judge`` sample waiting for the dispatcher: its row id, its turn, and the tries so far."""

    sample_id: str
    session_id: str
    turn_index: int
    attempts: int


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
