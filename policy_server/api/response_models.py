"""The policy server's 200 bodies as OpenAPI documents them: one model per route, each as exact as the route.

Role: the ops routes (``/v1/models``, ``/v1/models/{id}``, ``/health``, ``/ready``) build their bodies as these
models, so each of those bodies is written once; the other routes still return plain dicts (the chat answer on
the hot path) and their models document and check them: tests/reliability/test_schemathesis.py checks every
answer against these models, so a body that drifts from its model fails there. Nullable where the route may send null,
closed (no extra fields) where the route's body is fixed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CallFunction(_Closed):
    name: str
    arguments: str  # a JSON text


class ToolCallOut(_Closed):
    id: str
    index: int | None = None
    type: Literal["function"]
    function: CallFunction


class AssistantMessage(_Closed):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(_Closed):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Closed):
    content: list[TokenLogprob]


class Choice(_Closed):
    index: int = Field(..., ge=0)
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(_Closed):
    cached_tokens: int = Field(..., ge=0)


class Usage(_Closed):
    """OpenAI usage; ``prompt_tokens_details`` only when the engine reported its prefix-cache hit."""

    prompt_tokens: int = Field(..., ge=0)
    completion_tokens: int = Field(..., ge=0)
    total_tokens: int = Field(..., ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class HindsightExtension(_Closed):
    weight_version: str | None
    session_id: str | None


class ChatCompletion(_Closed):
    """``chat.completion`` (non-streaming); ``metadata`` is the request's own, echoed."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str = Field(..., max_length=256)
    choices: list[Choice] = Field(..., min_length=1, max_length=1)
    usage: Usage
    metadata: dict[str, str] | None = None
    hindsight: HindsightExtension


class ModelCard(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the served model an alias stands for
    weight_version: str | None
    history: Literal["sampled", "template"]  # how a continuing turn's history is rendered (docs/LONG_SESSIONS.md)
    tool_call_parser: str  # the markup tool calls are read and forced in (SGLang's parser names)
    reasoning_parser: str | None


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class Lease(_Closed):
    """A lease: ``lease_id`` null and ``samples`` empty when nothing was ready within ``wait_s``."""

    lease_id: str | None
    samples: list[dict[str, Any]]  # engine.records.SampleRecord JSON (CONTRACTS.md)
    lease_timeout_s: float
    prm_metrics: dict[str, float]
    trajectories: list[dict[str, Any]] | None = None  # with merge=true: the merged session trajectories


class AckResult(_Closed):
    lease_id: str
    acked: int = Field(..., ge=0)
    already_acked: bool


class ModeResult(_Closed):
    mode: str
    w_rl: float
    w_opd: float


class WeightsUpdated(_Closed):
    success: Literal[True]
    weight_version: str
    paused_s: float = Field(..., ge=0)


class Health(_Closed):
    status: Literal["ok"]


class Ready(_Closed):
    """``/ready``: the three checks for anyone; the detail fields only for the admin key's holder."""

    ready: bool
    engine: bool
    store: bool
    draining: bool
    engine_url: str | None = None
    weight_version: str | None = None
    gate_open: bool | None = None
    judge: bool | None = None
    store_detail: str | None = None


class SampleTurn(_Closed):
    pairing: str | None
    pairing_note: str | None
    next_state: list[dict[str, Any]] | None
    session_rule: str | None
    session_decision: str | None


class SampleRow(_Closed):
    """A sample row of ``/v1/samples`` (read-only view; ``sample`` is the Sample JSON once judged)."""

    sample_id: str
    session_id: str
    turn_index: int = Field(..., ge=0)
    status: str
    reject_reason: str | None
    attempts: int = Field(..., ge=0)
    last_error: str | None
    created_at: float
    updated_at: float
    sample: dict[str, Any] | None
    turn: SampleTurn


class SampleList(_Closed):
    samples: list[SampleRow]


class SideTurn(_Closed):
    side_id: str
    session_id: str | None
    created_at: float
    rule: str
    record: dict[str, Any]  # engine.records.TurnRecord JSON


class SideTurnList(_Closed):
    side_turns: list[SideTurn]


class FeedbackCounts(BaseModel):
    """Feedback counts by state (every state listed) and ``total``."""

    model_config = ConfigDict(extra="allow")
    total: int = Field(..., ge=0)


class FeedbackStats(FeedbackCounts):
    policy: str


class FeedbackResult(_Closed):
    feedback_id: str
    session_id: str
    turn_index: int = Field(..., ge=0)
    state: str
    sample_status: str | None
    duplicate: bool
    policy: str


class FeedbackRow(_Closed):
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


class FeedbackList(_Closed):
    feedback: list[FeedbackRow]
    stats: FeedbackCounts


class Dispatch(_Closed):
    processed: int = Field(..., ge=0)
    retries: int = Field(..., ge=0)
    running_sessions: int = Field(..., ge=0)


class SampleStats(_Closed):
    """``/v1/samples/stats``: the store's counters, the mode, dispatch, weights, PRM and feedback."""

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
    mode: ModeResult
    judge_configured: bool
    dispatch: Dispatch
    weight_version: str | None
    weight_updates: int = Field(..., ge=0)
    max_unconsumed_samples: int
    prm: dict[str, Any]  # {"enabled": false} or the scoring summary
    feedback: FeedbackStats


def ok(model: type[BaseModel], description: str = "success") -> dict[int | str, dict[str, Any]]:
    """A ``responses`` entry documenting the 200 body as ``model``."""
    return {200: {"model": model, "description": description}}
