"""The JSON object body every POST route of the policy server reads (chat, Responses, Messages, feedback), and the
strict reading of a body into its model that the Responses and Messages shapes use."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine.http_guard import BadJSON, parse_json_body
from engine.validation import clip_name, most_specific_error
from policy_server.errors import InvalidRequest

ModelT = TypeVar("ModelT", bound=BaseModel)


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


def parse_strict(model: type[ModelT], body: dict[str, Any]) -> ModelT:
    """``body`` as ``model`` for the routes of the other API shapes (Responses, Messages): a field the model
    does not define is a 400 naming it (never silently dropped), and so is a wrong value."""
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise InvalidRequest(
            f"unsupported field(s): {', '.join(clip_name(k) for k in unknown[:8])}; Hindsight rejects fields it "
            "does not implement instead of ignoring them",
            param=clip_name(unknown[0]),
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = most_specific_error(exc.errors())
        raise InvalidRequest(message, param=param) from None


def tool_name(value: Any, param: str) -> str:
    """A tool's name (a definition's, a call's, a forced choice's) in the other API shapes: a non-empty string,
    else a 400 naming ``param``, the field as that shape spells it."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param=param)
    return value
