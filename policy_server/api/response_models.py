"""The policy server's 200 bodies as OpenAPI documents them: one model per route, each as exact as the route.

Role: documentation and conformance only. Routes keep returning their plain dicts (no response_model
filtering on the hot path); tests/reliability/test_schemathesis.py checks every answer against these
models, so a body that drifts from its model fails there. Nullable where the route may send null,
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


class Usage(_Closed):
    prompt_tokens: int = Field(..., ge=0)
    completion_tokens: int = Field(..., ge=0)
    total_tokens: int = Field(..., ge=0)


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
    weight_version: str | None


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class Lease(_Closed):
    """A lease: ``lease_id`` null and ``samples`` empty when nothing was ready within ``wait_s``."""

    lease_id: str | None
    samples: list[dict[str, Any]]  # engine.records.SampleRecord JSON (CONTRACTS.md)
    lease_timeout_s: float
    prm_metrics: dict[str, float]


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


def ok(model: type[BaseModel], description: str = "success") -> dict[int | str, dict[str, Any]]:
    """A ``responses`` entry documenting the 200 body as ``model``."""
    return {200: {"model": model, "description": description}}
