"""The OpenAI chat-completions request at the HTTP edge: its typed shapes, their validation, the sampling mapping.

Contract (OpenAI chat completions, as SGLang's OpenAI server reads them): the body is a :class:`ChatRequest`;
wrong values of known fields are a 400 with a message naming the field (:func:`validate_messages`,
:func:`validate_tools`); the further OpenAI fields and the rejection of unknown ones are
policy_server.api.openai_fields. The body fallbacks ``session_id``/``turn_type``/``session_done`` are removed
before anything else sees the request (:func:`request_schema` documents them). The OpenAI fields become SGLang
``sampling_params`` here (:func:`sampling_params`). The answer bodies are policy_server.api.chat.completions.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    WithJsonSchema,
    field_validator,
)

from engine.validation import clip
from policy_server.api.route_docs import body_schema, inline_schema
from policy_server.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENT_PART_TYPES = ("text",)
SESSION_BODY_KEYS = ("session_id", "turn_type", "session_done")


# --- Typed shapes of the structured fields (messages, tools, tool_choice). They check TYPES and shapes only
# (a 400 naming the field instead of a crash deeper in); the request keeps the client's raw dicts, which
# are what gets rendered and recorded. Unknown keys inside them are allowed, as OpenAI's servers do.
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    # Only text parts are rendered; validate_messages refuses any other type naming it (the enum documents it).
    type: str = Field(..., min_length=1, json_schema_extra={"enum": list(CONTENT_PART_TYPES)})
    text: str | None = None

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None, info: Any) -> str | None:
        if v is None and info.data.get("type") == "text":
            raise ValueError("a text part needs text (a string)")
        return v


class ToolCallFunction(_Open):
    name: str = Field(..., min_length=1)
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message. Unknown fields are a 400 naming them, as OpenAI answers (not silently dropped)."""

    model_config = ConfigDict(extra="forbid")

    # Checked by validate_messages (its message names the bad role); the enum documents it in OpenAPI.
    role: str = Field(..., json_schema_extra={"enum": list(ROLES)})
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None


class FunctionDef(_Open):
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Open):
    name: str = Field(..., min_length=1)


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOLS = TypeAdapter(list[Tool] | None)
_TOOL_CHOICE = TypeAdapter(ToolChoice | None)


def _messages_schema() -> dict[str, Any]:
    """The messages array as validate_messages accepts it, one item schema per role: system/developer/user
    and tool messages need content (a string or text parts, not null), a tool message its tool_call_id; an
    assistant message may have null content. (That a tool_call_id names an earlier call is checked, not
    documented: JSON Schema cannot say it.)"""
    item = inline_schema(_MESSAGES)["items"]
    props = item["properties"]
    content = {**props["content"], "anyOf": [s for s in props["content"]["anyOf"] if s != {"type": "null"}]}
    content.pop("default", None)
    content["anyOf"][1] = {**content["anyOf"][1], "minItems": 1}

    def variant(roles: list[str], required: list[str], **extra: Any) -> dict[str, Any]:
        p = {**props, "role": {**props["role"], "enum": roles}, **extra}
        return {**item, "properties": p, "required": required}

    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                variant(["system", "developer", "user"], ["role", "content"], content=content),
                variant(["assistant"], ["role"]),
                variant(
                    ["tool"],
                    ["role", "content", "tool_call_id"],
                    content=content,
                    tool_call_id={"type": "string", "minLength": 1},
                ),
            ]
        },
    }


Messages = Annotated[list[dict[str, Any]], WithJsonSchema(_messages_schema())]
Tools = Annotated[list[dict[str, Any]] | None, WithJsonSchema(inline_schema(_TOOLS))]
ToolChoiceField = Annotated[str | dict[str, Any] | None, WithJsonSchema(inline_schema(_TOOL_CHOICE))]


class ChatRequest(BaseModel):
    # strict: a JSON value of the wrong type is a 400 ("8" is no max_tokens), never coerced
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, max_length=256)  # echoed in the answer: bounded
    messages: Messages = Field(..., min_length=1)
    tools: Tools = None
    tool_choice: ToolChoiceField = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 32:
            raise ValueError("at most 32 stop sequences")
        return v

    # The typed shapes above validate; the raw value is kept (see the comment on _Open).
    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        _MESSAGES.validate_python(v)
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        _TOOLS.validate_python(v)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        _TOOL_CHOICE.validate_python(v)
        return v


class ChatRequestDoc(ChatRequest):
    """The chat body as documented in OpenAPI: the request plus the session fallbacks (removed before use)."""

    session_id: str | None = Field(
        None, min_length=1, max_length=256, description="fallback for the X-Session-Id header"
    )
    turn_type: Literal["main", "side"] | None = Field(None, description="fallback for X-Turn-Type")
    session_done: bool | None = Field(None, description="fallback for X-Session-Done")


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """:func:`body_schema` with the session fallbacks every client route accepts (removed before the model sees
    the body)."""
    schema = body_schema(model)
    doc = inline_schema(TypeAdapter(ChatRequestDoc))["properties"]
    schema["properties"].update({k: doc[k] for k in SESSION_BODY_KEYS})
    return schema


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def validate_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check roles, contents and tool-call linkage; return template-ready copies (developer -> system)."""
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {clip(role)} is not one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}].content"
            )
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") for p in content):
            raise InvalidRequest(f"messages[{i}].content parts need a type", param=f"messages[{i}].content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part["type"] not in CONTENT_PART_TYPES:  # rendered as nothing otherwise: refused, not dropped
                raise InvalidRequest(
                    f"messages[{i}].content[{j}]: content part type {clip(part['type'])} is not supported "
                    f"(supported: {', '.join(CONTENT_PART_TYPES)})",
                    param=f"messages[{i}].content[{j}].type",
                )
        m = dict(msg)
        if role == "developer":
            m["role"] = "system"
        if role == "assistant":
            for j, tc in enumerate(msg.get("tool_calls") or []):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidRequest(
                        f"messages[{i}].tool_calls[{j}] needs function.name", param=f"messages[{i}].tool_calls"
                    )
                if fn.get("arguments") is None:  # the template renders them: a missing value cannot be guessed
                    raise InvalidRequest(
                        f"messages[{i}].tool_calls[{j}].function.arguments is required (a JSON string)",
                        param=f"messages[{i}].tool_calls[{j}].function.arguments",
                    )
                if isinstance(fn.get("arguments"), str) and not _is_json(fn["arguments"]):
                    raise InvalidRequest(
                        f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string",
                        param=f"messages[{i}].tool_calls[{j}].function.arguments",
                    )
                if tc.get("id"):
                    call_ids.add(str(tc["id"]))
        elif content is None:
            raise InvalidRequest(f"messages[{i}] ({role}) needs content", param=f"messages[{i}].content")
        if role == "tool":
            tcid = msg.get("tool_call_id")
            if not tcid:
                raise InvalidRequest(
                    f"messages[{i}] is a tool message without tool_call_id", param=f"messages[{i}].tool_call_id"
                )
            if str(tcid) not in call_ids:
                raise InvalidRequest(
                    f"messages[{i}].tool_call_id {clip(tcid)} does not match any earlier assistant tool call",
                    param=f"messages[{i}].tool_call_id",
                )
        out.append(m)
    return out


def validate_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=f"tools[{i}]"
            )
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            f"tool_choice {clip(tool_choice)} must be none, auto, required or a function", param="tool_choice"
        )
    if tool_choice not in (None, "none", "auto") and not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")


def sampling_params(req: ChatRequest, default_max_tokens: int, default_temperature: float = 1.0) -> dict[str, Any]:
    """OpenAI fields -> SGLang ``sampling_params`` (only the keys SGLang and the router accept).

    temperature and top_p are always sent explicitly (OpenAI's defaults when the client omits them), so the
    sample records the distribution the tokens were really drawn from and the trainer's off-policy
    correction never has to guess an engine-side default.
    """
    if req.n not in (None, 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    sp: dict[str, Any] = {"max_new_tokens": req.max_completion_tokens or req.max_tokens or default_max_tokens}
    sp["temperature"] = req.temperature if req.temperature is not None else default_temperature
    sp["top_p"] = req.top_p if req.top_p is not None else 1.0
    if req.stop:
        sp["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.seed is not None:
        sp["sampling_seed"] = req.seed
    if req.presence_penalty is not None:
        sp["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty is not None:
        sp["frequency_penalty"] = req.frequency_penalty
    return sp
