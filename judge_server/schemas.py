"""Pydantic I/O of the judge HTTP API (docs/CONTRACTS.md "Judge service").

Validation is strict where a wrong input would silently change the verdict: next-state roles are only
``user`` or ``tool``, tasks are ``prm``/``hint``. An empty judged response is valid (an empty reply is a turn).
FastAPI answers a violation with 422 and the field messages; size limits are checked in routes (413).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.records import HintVerdict, JudgeUsage, JudgeVerdicts, PrmVerdict, VerdictStatus

# The answer of ``POST /v1/judge`` (one per item of ``/v1/judge/batch``): the verdict models of record.
JudgeResponse = JudgeVerdicts
__all__ = [
    "BatchRequest",
    "HintVerdict",
    "JudgeRequest",
    "JudgeResponse",
    "JudgeUsage",
    "JudgedResponse",
    "Message",
    "NextStateMessage",
    "OpenRLHFRequest",
    "PrmVerdict",
    "SlimeRequest",
]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class NextStateMessage(Message):
    role: Literal["user", "tool"]


class JudgedResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # What stopped the reply (``stop``, ``length``, ``tool_calls``; Anthropic's ``max_tokens`` too): the
    # ``truncated`` guard reads it. Not shown to the judge model.
    finish_reason: str | None = None
    # An empty or whitespace reply is judged like any other: the model did produce it, and the user's
    # next state says how it went (refusing it would lose a real turn as a rejected sample).


JudgeTask = Literal["prm", "hint"]


def _every_task() -> list[JudgeTask]:
    return ["prm", "hint"]


class JudgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context: list[Message] = Field(default_factory=list)
    response: JudgedResponse
    next_state: list[NextStateMessage] = Field(min_length=1)
    tasks: list[JudgeTask] = Field(default_factory=_every_task, min_length=1)
    m: int | None = Field(default=None, ge=1)
    policy: Literal["fixed", "adaptive", "sequential"] | None = None
    # The tools the turn offered (OpenAI tool definitions); the ``malformed_tool_call`` guard checks the
    # reply's calls against their names. None: unknown (names are not checked).
    tools: list[dict[str, Any]] | None = None

    @field_validator("tasks")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("next_state")
    @classmethod
    def _has_text(cls, v: list[NextStateMessage]) -> list[NextStateMessage]:
        if all(not m.content for m in v):
            raise ValueError("next_state must contain at least one message with content")
        return v


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[JudgeRequest] = Field(min_length=1)


class OpenRLHFRequest(BaseModel):
    """OpenRLHF remote RM body: ``query`` (prompt+response strings), optional ``prompts`` and ``labels``."""

    model_config = ConfigDict(extra="allow")

    query: list[str] = Field(min_length=1)
    prompts: list[str] | None = None
    labels: list[Any] | None = None


class SlimeRequest(BaseModel):
    """slime ``--rm-url`` body: ``prompt`` (string or messages), ``response``, ``label`` (the next state)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | list[Message]
    response: str = Field(min_length=1)
    label: Any = None


class OpenRLHFRewards(BaseModel):
    """``/get_reward``'s answer: one reward per query (``scores`` the same list), and per query a 0/1 flag
    for each verdict status plus the confidence, as OpenRLHF's remote reward model reads them."""

    model_config = ConfigDict(extra="forbid")

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]


class SlimeReward(BaseModel):
    """``/slime/reward``'s answer (slime reads ``reward``); ``prm`` is the full verdict."""

    model_config = ConfigDict(extra="forbid")

    reward: float
    status: VerdictStatus
    confidence: float = Field(..., ge=0.0, le=1.0)
    prm: PrmVerdict
    prompt_versions: dict[str, str]


class JudgeReady(BaseModel):
    """``/ready`` (200 and 503 alike): the detail fields only for the key's holder."""

    model_config = ConfigDict(extra="forbid")

    ready: bool
    backend: str | None = None
    prompt_versions: dict[str, str] | None = None
    guards: dict[str, str] | None = None  # every guard rule's action (or off), as configured
    tokenizer_path: str | None = None
    engine_url: str | None = None


class JudgeHealth(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["ok"]


class JudgeBatchVerdicts(BaseModel):
    """``/v1/judge/batch``'s answer: one :class:`~engine.records.JudgeVerdicts` per item, in request order."""

    model_config = ConfigDict(extra="forbid")

    results: list[JudgeVerdicts]
