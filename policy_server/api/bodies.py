"""The JSON object body every POST route of the policy server reads (chat, Responses, Messages, feedback)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from engine.http_guard import BadJSON, parse_json_body
from policy_server.errors import InvalidRequest


async def read_json_object(request: Request, max_depth: int) -> dict[str, Any]:
    """The JSON object body. Its size was bounded while reading (engine.http_guard.BodyLimitMiddleware);
    deep nesting and unpaired surrogates are a 400 here, before any template or tokenizer sees them."""
    try:
        body = parse_json_body(await request.body(), max_depth=max_depth)
    except BadJSON as exc:
        raise InvalidRequest(str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body
