"""The policy server's 200 bodies as OpenAPI documents them: one model per route, each as exact as the route.

Role: the ops, admin, lease and feedback routes return their bodies as these models (the route's
``response_model``), so each of those bodies is written once; where the store's record is the body as it is
(an ack, a sample row, a side turn, a feedback row) the model is that record (policy_server.store.records). The chat
answer on the hot path is still a plain dict that its model documents and checks:
tests/reliability/test_schemathesis.py checks every answer against these models. Nullable where the route may send null,
closed (no extra fields) where the route's body is fixed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.records import MergedTrajectory, ModeSnapshot, Sample
from policy_server.store.records import FeedbackAnswer, FeedbackCounts, FeedbackRow, SampleRow, SideTurn, StoreCounts


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
    reasoning_switch: str | None  # the template variable ``reasoning_effort`` is passed as (engine.chat_families)


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class Lease(_Closed):
    """A lease: ``lease_id`` null and ``samples`` empty when nothing was ready within ``wait_s``; ``trajectories``
    only with ``merge=true`` (the merged session trajectories), absent otherwise."""

    lease_id: str | None
    samples: list[Sample]  # each as its JSON (CONTRACTS.md): the route answers without unset fields
    lease_timeout_s: float
    prm_metrics: dict[str, float]
    trajectories: list[MergedTrajectory] | None = None


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


class SampleList(_Closed):
    samples: list[SampleRow]


class SideTurnList(_Closed):
    side_turns: list[SideTurn]


class FeedbackStats(FeedbackCounts):
    """Feedback counts and the feedback policy in force."""

    policy: str


class FeedbackResult(FeedbackAnswer):
    """``POST /v1/feedback``: what the store did, and the feedback policy in force."""

    policy: str


class FeedbackList(_Closed):
    feedback: list[FeedbackRow]
    stats: FeedbackCounts


class Dispatch(_Closed):
    processed: int = Field(..., ge=0)
    retries: int = Field(..., ge=0)
    running_sessions: int = Field(..., ge=0)


class SampleStats(StoreCounts):
    """``/v1/samples/stats``: the store's counters, the mode, dispatch, weights, PRM and feedback."""

    mode: ModeSnapshot
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
