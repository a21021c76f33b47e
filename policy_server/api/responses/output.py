"""The ``response`` object and its output items, built from a chat answer (OpenAI Responses shapes).

Contract: the output items come in the order the model produced them: a ``reasoning`` item (the model's
``<think>`` text, in clear), a ``message`` item (``output_text``, with the rollout log-probs when asked)
and one ``function_call`` item per call (``call_id`` is the chat tool-call id). ``status`` is ``incomplete``
(reason ``max_output_tokens``) when the token budget ended the answer. The request's settings are echoed
as the Responses API does; usage counts the rendered prompt and the sampled tokens.
"""

from __future__ import annotations

import time
from typing import Any

from policy_server.api.responses.shapes import ResponsesRequest


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(
    item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str = "completed"
) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def output_items(hexid: str, message: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The output items of one chat assistant message, in the order the model wrote them."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(f"rs_{hexid}", message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(f"msg_{hexid}", message["content"], logprobs))
    for i, call in enumerate(message.get("tool_calls") or []):
        items.append(call_item(f"fc_{hexid}_{i}", call))
    return items


def response_object(
    req: ResponsesRequest,
    *,
    rid: str,
    model: str,
    created_at: float,
    status: str,
    output: list[dict[str, Any]],
    usage_obj: dict[str, Any] | None,
    hindsight: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object: the answer with the request's settings echoed, as the Responses API does."""
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    body: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "output": output,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "metadata": req.metadata,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": tool_choice,
        "tools": [{**t, "parameters": t.get("parameters"), "strict": t.get("strict")} for t in req.tools or []],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "text": {"format": {"type": "text"}}
        if req.text is None
        else req.text.model_dump(by_alias=True, exclude_none=True),
        "usage": usage_obj,
    }
    if status in ("completed", "incomplete"):
        body["completed_at"] = time.time()
    if hindsight is not None:
        body["hindsight"] = hindsight
    return body
