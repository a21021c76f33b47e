"""FastAPI app of the judge service: ``create_app(settings)`` with a lifespan holding the shared state.

Run: ``hindsight-judge --engine-url http://127.0.0.1:31100`` (see cli.py), or ``--backend rules`` without
an engine. The lifespan opens ONE EngineClient (one httpx.AsyncClient, explicit timeouts, trust_env off),
resolves the judge tokenizer (``tokenizer_path``, else the engine's local ``model_info.tokenizer_path``,
else text mode) and builds the JudgeService. Errors map to HTTP here and only here:
InvalidRequest -> 400/413, Unauthorized -> 401, request validation -> 422, anything unexpected -> 500
with a message (a bug, never an engine failure: those end as ``judge_failed`` tasks inside a 200).
Operations (engine.observability): every request gets an ``X-Request-ID`` (accepted or generated, echoed,
on every log line of that request, and forwarded to the judge engine on each engine call); the resolved
settings are logged at start with secrets masked; /metrics adds ``hindsight_judge_http_*`` route metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engine.chat import load_tokenizer
from engine.client import EngineClient, EngineTimeouts, RetryPolicy
from engine.errors import EngineError
from engine.http_guard import AdmissionMiddleware, BodyLimitMiddleware, UnexpectedErrorMiddleware
from engine.observability import RequestContextMiddleware, log_settings, propagate_request_id
from engine.validation import bounded_message, describe_validation_errors
from judge_server.errors import JudgeError
from judge_server.judge import JudgeService
from judge_server.metrics import JudgeMetrics
from judge_server.routes import router
from judge_server.settings import JudgeSettings

logger = logging.getLogger(__name__)


def endpoint(settings: JudgeSettings) -> tuple[str, str | None]:
    """(base URL, bearer key) of the judge's engine: ``engine_url`` for ``llm``; for ``openai`` ``base_url``
    without a trailing ``/v1`` (the client adds ``/v1/chat/completions``) and the key read from
    ``api_key_file`` (else ``engine_api_key``)."""
    if settings.backend != "openai":
        assert settings.engine_url
        return settings.engine_url, settings.engine_api_key
    assert settings.base_url
    url = settings.base_url.rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    key = settings.engine_api_key
    if settings.api_key_file:
        key = Path(settings.api_key_file).read_text(encoding="utf-8").strip() or None
    return url, key


def build_engine_client(settings: JudgeSettings) -> EngineClient:
    """The judge's one engine client: it owns its pool (explicit timeouts, sized limits, no env proxy), whose
    request hook forwards the caller's request/session ids to every engine call."""
    url, key = endpoint(settings)
    return EngineClient(
        url,
        api_key=key,
        timeouts=EngineTimeouts(connect_s=settings.engine_connect_timeout_s, read_s=settings.engine_read_timeout_s),
        retry=RetryPolicy(
            max_attempts=settings.engine_max_attempts,
            initial_backoff_s=settings.engine_initial_backoff_s,
            max_backoff_s=settings.engine_max_backoff_s,
            deadline_s=settings.request_deadline_s,
        ),
        max_connections=max(8, settings.max_concurrent_engine_calls * 2),
        event_hooks={"request": [propagate_request_id]},
    )


async def resolve_tokenizer(settings: JudgeSettings, client: EngineClient | None) -> tuple[Any, str | None]:
    """(tokenizer or None, its path). Loading runs in a thread: it reads files and is slow."""
    path = settings.tokenizer_path
    if path is None and client is not None:
        try:
            async with asyncio.timeout(5.0):
                info = await client.model_info()
            candidate = info.get("tokenizer_path") or info.get("model_path")
            if candidate and await asyncio.to_thread(os.path.isdir, candidate):
                path = candidate
        except (EngineError, TimeoutError) as exc:
            logger.warning("judge engine model_info unavailable (%s); judging in text mode", exc)
    if path is None:
        return None, None
    return await asyncio.to_thread(load_tokenizer, path), path


def _guard_error(status: int, message: str) -> dict[str, Any]:
    kind = {413: "InvalidRequest", 415: "UnsupportedMediaType", 429: "TooManyRequests"}.get(status, "InvalidRequest")
    return {"error": {"type": kind, "message": bounded_message(message)}}


def create_app(settings: JudgeSettings, *, engine_client: EngineClient | None = None) -> FastAPI:
    """The judge app; ``engine_client`` lets tests inject a client (e.g. with a fault-injecting transport)."""

    metrics = JudgeMetrics()  # per app, made here so the middleware below can record into it

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log_settings(logger, settings, title="judge")
        client, owned = engine_client, False
        if client is None and settings.backend in ("llm", "openai"):
            client, owned = build_engine_client(settings), True
        tokenizer, tok_path = (None, None)
        if settings.backend == "llm":
            tokenizer, tok_path = await resolve_tokenizer(settings, client)
        app.state.settings = settings
        app.state.metrics = metrics
        app.state.engine = client
        app.state.tokenizer_path = tok_path
        app.state.judge = JudgeService(settings, metrics, client=client, tokenizer=tokenizer)
        logger.info(
            "judge ready: backend=%s prompts=%s tokenizer=%s",
            settings.backend,
            app.state.judge.prompt_versions,
            tok_path or "none (text mode)",
        )
        try:
            yield
        finally:
            if owned and client is not None:
                await client.aclose()

    app = FastAPI(title="Hindsight judge", lifespan=lifespan)
    app.include_router(router)
    # Hostile-input guards (engine.http_guard): a body over the limit is a 413 while reading, a body
    # nested too deep or holding unpaired surrogates a 400, both before FastAPI parses it or auth runs;
    # admission bounds the requests in flight (429 beyond). Outermost: request ids and route metrics.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_request_chars,
        max_body_chars=settings.max_request_chars,
        require_json=True,
        error_body=_guard_error,
        json_max_depth=settings.max_json_depth,
    )
    app.add_middleware(AdmissionMiddleware, max_in_flight=settings.max_in_flight_requests, error_body=_guard_error)
    # Bugs: one 500 (the exception's type only) and one log record with the request id, tracebacks rate-limited.
    app.add_middleware(
        UnexpectedErrorMiddleware,
        logger=logger,
        error_body=lambda _s, msg: {"error": {"type": "InternalError", "message": msg}},
    )
    app.add_middleware(RequestContextMiddleware, route_metrics=metrics.routes)

    @app.exception_handler(JudgeError)
    async def _judge_error(_: Request, exc: JudgeError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse(
            {"error": {"type": type(exc).__name__, "message": bounded_message(exc.message)}},
            status_code=exc.status_code,
            headers=headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "type": "InvalidRequest",
                    "message": bounded_message(describe_validation_errors(exc.errors(), limit=None)),
                }
            },
            status_code=422,
        )

    return app
