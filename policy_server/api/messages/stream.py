"""The streaming ``/v1/messages`` answer: the chat turn's chunks re-emitted as Anthropic Messages events.

Contract (the event sequence the anthropic SDK accumulates, each with an ``event:`` line naming its type):
``message_start`` (the message with empty content and the input tokens), per content block
``content_block_start``, ``content_block_delta``... (``thinking_delta``, ``text_delta``, or for a
``tool_use`` block one ``input_json_delta`` with the whole arguments: the chat stream sends each call once
it parsed), ``content_block_stop``; then ``message_delta`` (stop_reason, stop_sequence, output tokens) and
``message_stop``. A failure after ``message_start`` is an ``error`` event in Anthropic's error shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from policy_server.api.messages import shapes as ms


def _event(kind: str, **payload: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


async def message_events(
    chunks: AsyncIterator[dict[str, Any]],
    start: dict[str, Any],
    stop: Callable[[str | None], tuple[str, str | None]],
) -> AsyncIterator[str]:
    """The Messages events of one chat stream (see the module docstring); ``start`` is the message of
    ``message_start``, ``stop(finish_reason)`` gives (stop_reason, stop_sequence) at the end."""
    yield _event("message_start", message=start)
    index, open_kind = -1, None
    finish, output_tokens, failed = None, 0, False

    def close() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [_event("content_block_stop", index=index)]

    def block(kind: str, first: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index, open_kind = index + 1, kind
        out.append(_event("content_block_start", index=index, content_block=first))
        return out

    async for chunk in chunks:  # read to its end, whatever happens: the chat stream settles its turn there
        if failed:
            continue
        if "error" in chunk:
            yield _event("error", error=ms.error_body(502, str(chunk["error"].get("message")))["error"])
            failed = True
            continue
        if chunk.get("usage") and not chunk.get("choices"):
            output_tokens = int(chunk["usage"]["completion_tokens"])
            continue
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            if open_kind != "thinking":
                for e in block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                    yield e
            yield _event(
                "content_block_delta",
                index=index,
                delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]},
            )
        if delta.get("content"):
            if open_kind != "text":
                for e in block("text", {"type": "text", "text": ""}):
                    yield e
            yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            fn = call["function"]
            first = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
            for e in block("tool_use", first):
                yield e
            partial = json.dumps(ms.tool_input(fn["arguments"]), ensure_ascii=False)
            yield _event(
                "content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": partial}
            )
        finish = choice.get("finish_reason") or finish
    if failed:
        return
    for e in close():
        yield e
    reason, sequence = stop(finish)
    yield _event(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": sequence},
        usage={"output_tokens": output_tokens},
    )
    yield _event("message_stop")
