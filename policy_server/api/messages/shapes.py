"""Anthropic Messages API shapes at the HTTP edge: the typed request, its conversion to the one chat input,
the ``message`` object built from a chat answer, and Anthropic's error body.

Contract (``POST /v1/messages``, as the typed models in ``anthropic.types`` describe it):

- ``system`` (a string or text blocks) is a leading system message; ``messages`` alternate user and
  assistant turns whose content is a string or blocks: ``text``, ``tool_use`` (assistant), ``tool_result``
  (user: one chat ``tool`` message each, before the user's text) and ``thinking`` (assistant: its text is the
  message's ``reasoning_content``). Every other block type (images, documents, redacted thinking) is a 400
  naming it.
- ``tools`` carry ``input_schema``; ``tool_choice`` is auto, any (a call is required), tool (that tool is
  forced, decoded under its schema as on chat) or none; ``disable_parallel_tool_use`` is
  ``parallel_tool_calls: false``. ``max_tokens`` is required; ``stop_sequences``, ``temperature``, ``top_p``,
  ``metadata.user_id`` and ``thinking`` (``reasoning_effort`` ``none`` when disabled, ``medium`` when enabled,
  through the template's own switch; adaptive leaves the template's default) are honoured; any other field is a
  400 naming it.
- The answer's content lists a ``thinking`` block (the model's ``<think>`` text, empty signature), a ``text``
  block and one ``tool_use`` block per call (``id`` is the chat tool-call id, ``input`` the parsed
  arguments). ``stop_reason`` is ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the matched
  ``stop_sequence``) or ``end_turn``.
- ``POST /v1/messages/count_tokens`` takes the prompt part of the request (``model``, ``messages``, ``system``,
  ``tools``, ``tool_choice``, ``thinking``: :class:`MessagesPrompt`), converted exactly as above.
- Every error of a Messages route is :func:`error_body`'s envelope (policy_server.errors.ErrorShapeMiddleware).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.validation import clip
from policy_server.api.bodies import parse_strict, tool_name
from policy_server.errors import InvalidRequest

# Anthropic's error type per HTTP status (its documented error shapes); any other status is a client's
# ``invalid_request_error`` below 500, the server's ``api_error`` from 500 on.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class MessagesPrompt(_Strict):
    """What a Messages request renders into its prompt: the ``/v1/messages/count_tokens`` body."""

    model: str | None = Field(None, max_length=256)
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None


class MessagesRequest(MessagesPrompt):
    """The ``/v1/messages`` body (the session fallbacks were removed before)."""

    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=32)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    metadata: Metadata | None = None
    stream: bool = False


def parse_request(body: dict[str, Any]) -> MessagesRequest:
    """The typed request; an unknown field or a wrong value is a 400 naming it."""
    return parse_strict(MessagesRequest, body)


def parse_prompt(body: dict[str, Any]) -> MessagesPrompt:
    """The typed ``count_tokens`` request; an unknown field or a wrong value is a 400 naming it."""
    return parse_strict(MessagesPrompt, body)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise InvalidRequest(f"{where}.content must be a string or a list of blocks", param=f"{where}.content")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{where} needs text (a string)", param=where)
    return str(block["text"])


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise InvalidRequest(f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id")
    parts = _blocks(block.get("content", ""), where)
    text = "".join(_text(p, f"{where}.content") for p in parts if p.get("type") == "text")
    if any(p.get("type") != "text" for p in parts):
        raise InvalidRequest(f"{where}.content may hold text blocks only", param=f"{where}.content")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def chat_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    """``system`` + ``messages`` as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(_text(b, "system") for b in req.system)
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{where}.role {clip(role)} is not user or assistant", param=f"{where}.role")
        texts: list[str] = []
        if role == "user":
            for j, block in enumerate(_blocks(msg.get("content"), where)):
                bw = f"{where}.content[{j}]"
                if block.get("type") == "tool_result":
                    out.append(_tool_result(block, bw))
                elif block.get("type") == "text":
                    texts.append(_text(block, bw))
                else:
                    raise InvalidRequest(f"{bw} of type {clip(block.get('type'))} is not supported", param=f"{bw}.type")
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
            continue
        assistant: dict[str, Any] = {"role": "assistant", "content": None}
        for j, block in enumerate(_blocks(msg.get("content"), where)):
            bw, kind = f"{where}.content[{j}]", block.get("type")
            if kind == "text":
                texts.append(_text(block, bw))
            elif kind == "thinking":
                assistant["reasoning_content"] = str(block.get("thinking") or "")
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str):
                    raise InvalidRequest(f"{bw}.id must be a string", param=f"{bw}.id")
                name = tool_name(block.get("name"), f"{bw}.name")
                args = json.dumps(block.get("input") or {}, ensure_ascii=False)
                call = {"id": block["id"], "type": "function", "function": {"name": name, "arguments": args}}
                assistant.setdefault("tool_calls", []).append(call)
            else:
                raise InvalidRequest(f"{bw} of type {clip(kind)} is not supported", param=f"{bw}.type")
        if texts:
            assistant["content"] = "".join(texts)
        out.append(assistant)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or "name" not in tool:
            raise InvalidRequest(
                f"tools[{i}] is not supported (client tools with a name and input_schema only)", param=f"tools[{i}]"
            )
        name = tool_name(tool["name"], f"tools[{i}].name")
        fn = {"name": name, "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def prompt_body(req: MessagesPrompt) -> dict[str, Any]:
    """The chat-completions fields of what this request renders: messages, tools, tool choice, thinking."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools is not None:
        body["tools"] = chat_tools(req.tools)
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind in ("auto", "none"):
            body["tool_choice"] = kind
        elif kind == "any":
            body["tool_choice"] = "required"
        elif kind == "tool":
            name = tool_name(choice.get("name"), "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        else:
            raise InvalidRequest("tool_choice must be auto, any, none or {type: tool, name}", param="tool_choice")
        if choice.get("disable_parallel_tool_use") is True and kind != "none":
            body["parallel_tool_calls"] = False
    if req.thinking is not None and req.thinking.type != "adaptive":
        # Through the template's own reasoning switch (engine.chat_families): off, or on at the usual level.
        body["reasoning_effort"] = "none" if req.thinking.type == "disabled" else "medium"
    return body


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body of this request."""
    body = prompt_body(req)
    body["max_tokens"], body["stream"] = req.max_tokens, req.stream
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # message_delta carries the output tokens
    return body


# ---------------------------------------------------------------------------------------------- output
def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as Anthropic's ``input`` object (the chat parser emits JSON objects)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": tool_input(fn["arguments"])})
    return blocks


def stop_reason(finish: str | None, stop: str | None, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason and the engine's matched stop string."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop is not None and stop in (stop_sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def message_object(
    *, mid: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None], usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }
