"""The chat-completions answer bodies: a ``chat.completion`` object and ``chat.completion.chunk`` events.

Role: build the JSON the chat route answers with (policy_server.api.chat.answer) and streams
(policy_server.api.chat.streaming), in the shape SGLang's OpenAI server answers: ``choices`` of one, OpenAI's
``usage`` (with ``prompt_tokens_details.cached_tokens`` when the engine reported a prefix-cache hit), the finish
reason as OpenAI names it. policy_server.api.response_models documents and checks these bodies.
"""

from __future__ import annotations

import time
from typing import Any


def finish_reason(engine_finish: dict[str, Any], has_tool_calls: bool) -> str:
    kind = engine_finish.get("type")
    if kind == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` (the engine's prefix-cache hit) when the engine said."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion(
    *,
    rid: str,
    model: str,
    message: dict[str, Any],
    finish: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
    hindsight: dict[str, Any] | None = None,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """``metadata`` is the client's own (echoed); Hindsight's values go in the ``hindsight`` extension field."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    if metadata is not None:
        body["metadata"] = metadata
    if hindsight is not None:
        body["hindsight"] = hindsight
    return body


def chunk(
    *,
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage_obj: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    if usage_obj is not None:
        body["choices"] = []
        body["usage"] = usage_obj
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}]
    return body
