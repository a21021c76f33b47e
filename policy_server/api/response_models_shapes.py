"""The 200 bodies of the Responses (``/v1/responses``) and Messages (``/v1/messages``) routes as OpenAPI
documents them (non-streaming; the event streams are documented as ``text/event-stream``).

Role: documentation and conformance only, like :mod:`policy_server.api.response_models`: the routes build
plain dicts (policy_server.api.responses.output, policy_server.api.messages.shapes) and
tests/reliability/test_schemathesis.py checks every answer against these models. Closed where the body is
fixed; the request settings the Responses API echoes keep the request's own types.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policy_server.api.response_models import HindsightExtension, TokenLogprob


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------- Responses
class ReasoningText(_Closed):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Closed):
    type: Literal["reasoning"]
    id: str
    summary: list[dict[str, Any]]
    content: list[ReasoningText]
    status: Literal["completed", "incomplete"]


class OutputText(_Closed):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[TokenLogprob] | None = None


class MessageItem(_Closed):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(_Closed):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON text
    status: Literal["completed", "incomplete"]


OutputItem = Annotated[ReasoningItem | MessageItem | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(_Closed):
    cached_tokens: int = Field(..., ge=0)
    cache_write_tokens: int = Field(..., ge=0)


class OutputTokensDetails(_Closed):
    reasoning_tokens: int = Field(..., ge=0)


class ResponseUsage(_Closed):
    input_tokens: int = Field(..., ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(..., ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(..., ge=0)


class IncompleteDetails(_Closed):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Closed):
    """``response`` (non-streaming): the output items in the model's order, the request's settings echoed."""

    id: str
    object: Literal["response"]
    created_at: float
    completed_at: float | None = None
    model: str = Field(..., max_length=256)
    status: Literal["completed", "incomplete"]
    output: list[OutputItem]
    error: dict[str, Any] | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    metadata: dict[str, str] | None
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any]
    tools: list[dict[str, Any]]
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    text: dict[str, Any]
    usage: ResponseUsage | None
    hindsight: HindsightExtension | None


# ---------------------------------------------------------------------------- Messages
class ThinkingBlock(_Closed):
    type: Literal["thinking"]
    thinking: str
    signature: str


class TextBlock(_Closed):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Closed):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[ThinkingBlock | TextBlock | ToolUseBlock, Field(discriminator="type")]


class MessageUsage(_Closed):
    input_tokens: int = Field(..., ge=0)
    output_tokens: int = Field(..., ge=0)


class TokenCount(_Closed):
    """Anthropic's ``count_tokens`` answer: the prompt's length in the policy tokenizer's tokens."""

    input_tokens: int = Field(..., ge=0)


class MessageObject(_Closed):
    """Anthropic's ``message`` (non-streaming)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str = Field(..., max_length=256)
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage
    hindsight: HindsightExtension | None
