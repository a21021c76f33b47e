"""How the policy server's routes are documented in OpenAPI, and the error envelope every route answers with.

Role: the OpenAPI pieces every route shares, whatever its API shape (chat, Responses, Messages, the lease, admin,
feedback, weights and session routes): the error statuses a route really answers (:func:`error_responses`, each
documented with OpenAI's error envelope, :class:`ErrorResponse`) and the request body of a route that reads its
body itself (:func:`body_schema`, :func:`json_request_body`), with nested schemas inlined (:func:`inline_schema`).
The error bodies themselves are written by policy_server.errors; this module only documents them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter


def inline_schema(adapter: TypeAdapter[Any]) -> dict[str, Any]:
    """The adapter's JSON schema with its ``$defs`` inlined (FastAPI's OpenAPI does not carry nested defs)."""
    schema = adapter.json_schema()
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.split("/")[-1]])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every error of the policy server has this body."""

    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the error statuses a route really answers."""
    return {code: {"model": ErrorResponse, "description": _ERROR_TEXT[code]} for code in codes}


_ERROR_TEXT = {
    400: "invalid request (names the field)",
    401: "missing or wrong bearer key",
    404: "unknown object (a model not served: code model_not_found)",
    409: "conflict (expired lease)",
    413: "body over max_body_bytes (refused while reading)",
    415: "Content-Type is not JSON",
    429: "too many requests in flight, or sample backlog full (Retry-After)",
    502: "engine answered badly",
    503: "engine unreachable, store busy or shutting down (Retry-After)",
    504: "engine timed out",
}


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request-body schema of a route that reads its body itself with ``model`` (``$defs`` inlined)."""
    return inline_schema(TypeAdapter(model))


def json_request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """A route's ``openapi_extra`` for a required JSON body of ``schema`` (routes that read the raw body, so
    FastAPI does not document it from a parameter)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
