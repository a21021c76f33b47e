"""OpenAI Responses API shapes at the HTTP edge: the typed request, its conversion to the one chat input,
and the ``response`` object built from a chat answer.

Contract (``POST /v1/responses``, as OpenAI's typed models in ``openai.types.responses`` describe it):

- ``input`` is a string (one user message) or a list of items: ``message`` (roles user, system, developer,
  assistant; content a string or ``input_text``/``output_text`` parts), ``function_call``,
  ``function_call_output`` and ``reasoning`` (its text becomes the ``reasoning_content`` of the assistant
  message that follows). Every other item or part type is a 400 naming it. ``instructions`` is a leading
  system message. Consecutive assistant items (text, calls) form one chat assistant message, so a tool loop
  renders and pairs exactly like the same loop on chat completions.
- ``tools`` are ``function`` tools; ``tool_choice`` is auto, none, required, ``{"type": "function",
  "name"}`` (a forced call decodes under its schema, as on chat) or ``{"type": "allowed_tools", "mode",
  "tools"}`` (only those tools are offered this turn, under ``mode``). ``text.format`` json_schema/json_object is
  constrained decoding; ``include: ["message.output_text.logprobs"]`` (+ ``top_logprobs``) returns the
  rollout log-probs of the output text. ``max_output_tokens``, ``temperature``, ``top_p``,
  ``parallel_tool_calls``, ``metadata`` (echoed), ``user``/``safety_identifier``, ``store``,
  ``previous_response_id`` and ``reasoning.effort`` (none/minimal render with thinking off) are honoured;
  ``prompt_cache_key`` is accepted (no prompt cache is keyed by it); ``include: ["reasoning.encrypted_content"]``
  is served by reasoning items whose text is in clear. Any other field is a 400 naming it (nothing is
  silently dropped).
- The answer (policy_server.api.responses.output) is the Responses shape of the chat answer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.validation import clip
from policy_server.api.bodies import parse_strict, tool_name
from policy_server.errors import InvalidRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Stateless clients ask for encrypted reasoning to send it back; reasoning items here carry their text in
# clear (``content``), which round-trips the same way, so the request is served rather than refused.
REASONING_INCLUDE = "reasoning.encrypted_content"
TEXT_PARTS = ("input_text", "output_text", "text")
SESSION_KEYS = ("session_id", "turn_type", "session_done")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema formats carry name/schema/strict/description

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """The ``/v1/responses`` body (the session fallbacks ``session_id``/``turn_type``/``session_done`` were
    removed before)."""

    model: str | None = Field(None, max_length=256)
    input: str | list[dict[str, Any]] = Field(..., min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = Field(None, max_length=8)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool = False
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)  # no cache to key here; a session hint at most
    reasoning: Reasoning | None = None
    truncation: Literal["disabled"] | None = None


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """The typed request; an unknown field, a wrong value or an unsupported ``include`` is a 400 naming it."""
    req = parse_strict(ResponsesRequest, body)
    for value in req.include or []:
        if value not in (LOGPROBS_INCLUDE, REASONING_INCLUDE):
            raise InvalidRequest(
                f"include {clip(value)} is not supported (only {LOGPROBS_INCLUDE!r}, {REASONING_INCLUDE!r})",
                param="include",
            )
    return req


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}.content[{j}] of type {clip(kind)} is not supported (text parts only)",
                param=f"{where}.content[{j}].type",
            )
        out.append(part["text"])
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (see the module docstring); every unsupported item is a 400 naming it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        # Text, calls and reasoning of one model turn arrive as consecutive items: one assistant message.
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or (last.get("tool_calls") and reasoning is not None):
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"], reasoning = reasoning, None
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    f"{where}.role {clip(role)} is not user, system, developer or assistant", param=where
                )
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                msg = assistant()
                msg["content"] = (msg["content"] or "") + text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise InvalidRequest(f"{where} needs name, arguments and call_id (strings)", param=where)
            tool_name(name, f"{where}.name")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise InvalidRequest(f"{where} of type {clip(kind)} is not supported", param=f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or "name" not in tool:
            raise InvalidRequest(
                f"tools[{i}] of type {clip(tool.get('type'))} is not supported (function tools with a name only)",
                param=f"tools[{i}].type",
            )
        tool_name(tool["name"], f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def allowed_tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """``tool_choice: {"type": "allowed_tools", "mode", "tools"}``: the tools the model may call this turn (the
    others are not rendered into its prompt) and the chat ``tool_choice`` (``mode``: auto or required)."""
    names = [t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)]
    mode = choice.get("mode")
    if not isinstance(mode, str) or mode not in ("auto", "required") or not names:
        raise InvalidRequest(
            "tool_choice allowed_tools needs mode auto or required and function tools by name", param="tool_choice"
        )
    declared = {t.get("name") for t in tools or []}
    missing = [str(n) for n in names if not isinstance(n, str) or n not in declared]
    if missing:
        raise InvalidRequest(
            f"tool_choice allowed_tools names undeclared tool(s): {', '.join(missing)}", param="tool_choice"
        )
    return [t for t in tools or [] if t.get("name") in names], mode


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or "name" not in choice:
        raise InvalidRequest(
            "tool_choice must be auto, none, required, {type: function, name} or {type: allowed_tools, ...}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": tool_name(choice["name"], "tool_choice.name")}}


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body of this request (``messages`` with the prefix and instructions included)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    tools: list[dict[str, Any]] | None = req.tools
    choice: str | dict[str, Any] | None = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools, choice = allowed_tools(tools, choice)
    if tools is not None:
        body["tools"] = chat_tools(tools)
    if choice is not None:
        body["tool_choice"] = chat_tool_choice(choice)
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.metadata is not None:
        body["metadata"] = req.metadata
    if (req.user or req.safety_identifier) is not None:
        body["user"] = req.user or req.safety_identifier
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if LOGPROBS_INCLUDE in (req.include or []):
        body["logprobs"] = True
        if req.top_logprobs:
            body["top_logprobs"] = req.top_logprobs
    elif req.top_logprobs:
        raise InvalidRequest(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", param="top_logprobs")
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return body
