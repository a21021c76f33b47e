"""The policy server's error tree and its single mapping to HTTP (OpenAI error shape).

    PolicyError
    ├── InvalidRequest       400 bad body, unknown role, tool message without a matching call, bad header
    ├── Unauthorized         401 missing/wrong bearer key
    ├── NotFound             404 unknown lease, unknown route object
    ├── Conflict             409 lease expired
    ├── PayloadTooLarge      413 body over max_body_bytes
    ├── Backpressure         429 the store holds max_unconsumed_samples not yet consumed
    ├── ServiceUnavailable   503 gate timeout during weight sync, shutting down
    │   └── StoreBusy        503 the SQLite store could not be reached within its busy timeout
    └── UpstreamFailed       50x generation could not finish (wraps EngineError)

``engine.template_inputs.TemplateRefused`` (the model's chat template refused the conversation: its own
``raise_exception``, a role or value it cannot render) is a 400 ``invalid_request_error`` with code
``template_refused`` whose message quotes the template's complaint. ``engine.errors`` are mapped here too (EngineUnavailable 503, EngineTimeout 504, EngineBadResponse 502,
EngineRejected 400), after the engine client's own retries. Every error body is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` so the official client raises the right class; on the
Anthropic Messages routes (``/v1/messages`` and every path under it, unknown ones included) it is Anthropic's
``{"type": "error", "error": {"type", "message"}}``, translated once by :class:`ErrorShapeMiddleware` whichever
layer answered (a handler here, a request guard, the drain, the top-level 500).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    EngineBadResponse,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)
from engine.template_inputs import TemplateRefused
from engine.validation import ECHO_MAX_CHARS, bounded_message, describe_validation_errors

logger = logging.getLogger(__name__)


class PolicyError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(PolicyError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(PolicyError):
    status_code = 401
    error_type = "authentication_error"


class NotFound(PolicyError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(PolicyError):
    status_code = 409
    error_type = "conflict_error"


class PayloadTooLarge(PolicyError):
    status_code = 413
    error_type = "invalid_request_error"


class Backpressure(PolicyError):
    status_code = 429
    error_type = "rate_limit_error"


class ServiceUnavailable(PolicyError):
    status_code = 503
    error_type = "service_unavailable"


class StoreBusy(ServiceUnavailable):
    """The store's lock or SQLite's write lock was not free within ``store_busy_timeout_s``: retry later."""


class UpstreamFailed(PolicyError):
    status_code = 502
    error_type = "upstream_error"


RETRY_AFTER_S = 2
_ENGINE_STATUS = {EngineUnavailable: 503, EngineTimeout: 504, EngineBadResponse: 502, EngineRejected: 400}


def error_body(
    status: int, message: str, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, object]:
    return {
        "error": {
            "message": bounded_message(message),
            "type": error_type,
            "param": None if param is None else bounded_message(param, ECHO_MAX_CHARS * 2),
            "code": code if code is not None else status,
        }
    }


def engine_error_status(exc: EngineError) -> int:
    for cls, status in _ENGINE_STATUS.items():
        if isinstance(exc, cls):
            return status
    return 502


# Routes of another API shape answer their errors in that shape: path prefix -> (status, message) -> body.
ErrorShapes = Mapping[str, Callable[[int, str], dict[str, Any]]]


def shape_for(shapes: ErrorShapes, path: str) -> Callable[[int, str], dict[str, Any]] | None:
    """The error shape of ``path``: that of the prefix it is (``/v1/messages``) or lies under
    (``/v1/messages/count_tokens``, an unknown ``/v1/messages/x``), else None (OpenAI's)."""
    for prefix, shape in shapes.items():
        if path == prefix or path.startswith(prefix + "/"):
            return shape
    return None


class ErrorShapeMiddleware:
    """Pure ASGI, around every other guard: on a path of ``shapes`` an error answer (status >= 400 with
    OpenAI's JSON envelope), whoever wrote it (the handlers below, the body-limit 413/415, the admission 429,
    the drain 503, the 500 of a bug), leaves in that path's shape with the same status, message and headers.
    Errors are built in one shape everywhere and translated here once, so no guard needs to know the routes."""

    def __init__(self, app: Any, *, shapes: ErrorShapes):
        self.app = app
        self.shapes = shapes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        shape = shape_for(self.shapes, scope.get("path", "")) if scope["type"] == "http" else None
        if shape is None:
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] | None = None  # the start of an error answer, sent once its body is rewritten
        chunks: list[bytes] = []

        async def shaping_send(message: dict[str, Any]) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status = held["status"]
            body = _reshaped(b"".join(chunks), status, shape)
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
            await send({**held, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaping_send)


def _reshaped(raw: bytes, status: int, shape: Callable[[int, str], dict[str, Any]]) -> bytes:
    """An OpenAI error body in ``shape``; any other body unchanged (it is not ours to reinterpret)."""
    try:
        detail = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return raw
    if not isinstance(detail, dict) or not isinstance(detail.get("message"), str):
        return raw
    return json.dumps(shape(status, detail["message"])).encode()


def install_error_handlers(app: FastAPI) -> None:
    """The one place where exceptions become HTTP responses, in OpenAI's envelope (routes of another shape get
    theirs from :class:`ErrorShapeMiddleware`)."""

    @app.exception_handler(PolicyError)
    async def _policy(request: Request, exc: PolicyError) -> JSONResponse:
        # 429/503 are "come back later": say when, so clients back off instead of hammering.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status_code in (429, 503) else None
        body = error_body(exc.status_code, exc.message, exc.error_type, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        status = engine_error_status(exc)
        logger.warning("engine failure -> HTTP %d: %s", status, exc)
        kind = "invalid_request_error" if status == 400 else "upstream_error"
        return JSONResponse(error_body(status, f"policy engine: {exc.message}", kind), status_code=status)

    @app.exception_handler(TemplateRefused)
    async def _template(request: Request, exc: TemplateRefused) -> JSONResponse:
        body = error_body(400, exc.message, "invalid_request_error", "messages", "template_refused")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = "invalid request: " + describe_validation_errors(exc.errors(), limit=5)
        return JSONResponse(error_body(400, message, "invalid_request_error"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers carries e.g. the Allow header of a 405, which HTTP requires.
        body = error_body(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    # Anything else is a bug: engine.http_guard.UnexpectedErrorMiddleware (installed by create_app, inside
    # ErrorShapeMiddleware and the request-id middleware) answers it 500 with one log record, the traceback
    # rate-limited.
