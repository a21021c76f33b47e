"""HTTP layer of the CPU dev engine: SGLang 0.5.23's endpoints, thin routes over ``DevEngine``.

Contract: SGLang 0.5.23's endpoint set with its field names and shapes. Errors are mapped in one place:
``ProtocolError`` -> 400 in SGLang's shape (``{"error": str}`` for contract errors, ``{"error": {"message"}}``
for semantic ones), malformed JSON -> 400, chat errors -> OpenAI's ``{"object": "error", ...}``. Auth follows
SGLang's ``decide_request_auth`` (the bearer check is engine.auth's): ``/health*``, ``/ready*``, ``/metrics*``
are open; admin endpoints need the admin key when one is set (the api key is then not accepted), else the
api key; every other endpoint needs the api key if set.
Operations (engine.observability): ``X-Request-ID`` accepted or generated, echoed and logged; the resolved
settings (secrets masked) logged at start; ``GET /metrics`` serves SGLang-named metrics (see metrics.py) and
``hindsight_dev_engine_http_*`` route metrics, open without auth as in SGLang.

    app = create_app(DevEngineSettings(model_path=DIR))  # the model loads in the lifespan
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from devkit.dev_server.openai_chat import ChatError, chat_completions
from devkit.dev_server.protocol import ProtocolError
from devkit.dev_server.recording import RequestRecorder
from devkit.dev_server.service import DevEngine
from devkit.dev_server.settings import DevEngineSettings
from engine.auth import bearer_problem
from engine.disconnect import CLIENT_CLOSED_STATUS, ClientGone, unless_disconnected
from engine.http_guard import AdmissionMiddleware, BadJSON, BodyLimitMiddleware, parse_json_body
from engine.observability import RequestContextMiddleware, RouteMetrics, log_settings
from engine.validation import describe_validation_errors

logger = logging.getLogger(__name__)

VERSION = "0.5.23-dev"
ADMIN_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
UNSUPPORTED_UPDATES = (
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
)


def decide_auth(path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """SGLang 0.5.23's rule as a pure function; the bearer check itself is engine.auth's."""
    if path.startswith(OPEN_PREFIXES):
        return True
    key = (admin_api_key or api_key) if path in ADMIN_PATHS else api_key
    return bearer_problem(authorization, key) is None


async def read_json(request: Request, *, required: bool) -> Any:
    """Decode the body; malformed JSON (or a missing body where SGLang needs one) is a 400, never a 500."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ProtocolError("a JSON body is required (send at least {})")
        return {}
    try:
        return parse_json_body(raw, max_depth=request.app.state.max_json_depth)
    except BadJSON as exc:
        raise ProtocolError(f"malformed JSON body: {exc}", contract=True) from None


async def read_object(request: Request) -> dict[str, Any]:
    body = await read_json(request, required=True)
    if not isinstance(body, dict):
        raise ProtocolError("the JSON body must be an object")
    return body


def create_app(settings: DevEngineSettings) -> FastAPI:
    registry = CollectorRegistry()  # per app: tests run several apps in one process

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log_settings(logger, settings, title="dev engine")
        torch.set_num_threads(settings.torch_threads)
        engine = await asyncio.to_thread(DevEngine, settings, registry)
        app.state.engine = engine
        app.state.started_at = time.time()
        logger.info(
            "dev engine ready: %s (vocab %d, context %d)",
            settings.model_path,
            engine.runner.vocab_size,
            engine.runner.context_length,
        )
        yield
        engine.close()

    app = FastAPI(title="hindsight-dev-engine", lifespan=lifespan)

    def eng(request: Request) -> DevEngine:
        return request.app.state.engine

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if not decide_auth(
            request.url.path, request.headers.get("authorization"), settings.api_key, settings.admin_api_key
        ):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    app.state.max_json_depth = settings.max_json_depth
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, error_body=lambda _status, msg: {"error": msg}
    )
    app.add_middleware(
        AdmissionMiddleware,
        max_in_flight=settings.max_in_flight_requests,
        error_body=lambda _status, msg: {"error": msg},
    )
    if settings.record_requests:  # a body refused by the auth check is never read, so never recorded
        app.add_middleware(RequestRecorder, path=settings.record_requests)
    # Added last, so outermost: 401s from the auth middleware get a request id and are counted too.
    app.add_middleware(RequestContextMiddleware, route_metrics=RouteMetrics(registry, "hindsight_dev_engine"))

    @app.exception_handler(ProtocolError)
    async def protocol_error(_: Request, exc: ProtocolError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(ChatError)
    async def chat_error(_: Request, exc: ChatError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(ChatError(describe_validation_errors(exc.errors())).body(), status_code=400)

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    @app.get("/ready")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        engine = eng(request)
        if engine.control.paused or engine.control.updating:
            return Response(status_code=200)  # a held generation proves nothing and would block the probe
        try:
            await asyncio.wait_for(
                engine.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}), timeout=20
            )
        except (TimeoutError, ProtocolError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(eng(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(request: Request) -> dict[str, Any]:
        engine = eng(request)
        cfg = engine.runner.model.config
        return {
            "model_path": engine.runner.model_path,
            "tokenizer_path": settings.model_path,
            "served_model_name": engine.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.runner.weight_version,
            "load_format": "auto",
            "reasoning_parser": "qwen3" if settings.reasoning_parser else None,
            "tool_call_parser": "qwen25" if settings.tool_call_parser else None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        engine = eng(request)
        return {
            "model_path": engine.runner.model_path,
            "tokenizer_path": settings.model_path,
            "served_model_name": engine.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "host": settings.host,
            "port": settings.port,
            "context_length": engine.runner.context_length,
            "random_seed": settings.seed,
            "weight_version": engine.runner.weight_version,
            "max_req_input_len": engine.runner.context_length - 1,
            "max_total_num_tokens": engine.runner.context_length,
            "startup_time": request.app.state.started_at,
            "internal_states": [{}],
            "version": VERSION,
            "frontend": "python",
        }

    def model_card(engine: DevEngine) -> dict[str, Any]:
        return {
            "id": engine.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": engine.served_model_name,
            "parent": None,
            "max_model_len": engine.runner.context_length,
        }

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(eng(request))]}

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Any:
        engine = eng(request)
        if model != engine.served_model_name:
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model '{model}' does not exist",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status_code=404,
            )
        return model_card(engine)

    @app.get("/get_weight_version")
    async def get_weight_version(request: Request) -> dict[str, Any]:
        return {"weight_version": eng(request).runner.weight_version}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        if eng(request).control.num_requests():
            return PlainTextResponse(
                "Cache not flushed. Please check backend logs for more details. (When there "
                "are running or waiting requests, the operation will not be performed.)\n",
                status_code=400,
            )
        eng(request).runner.prefix_cache.clear()
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await read_json(request, required=True)
        engine = eng(request)
        if isinstance(body, dict) and body.get("stream") is True:
            return StreamingResponse(engine.stream_generate(body), media_type="text/event-stream")
        try:
            # As SGLang does, a caller that hangs up aborts its generation (the run's CancelledError marks the
            # request aborted); a StreamingResponse already notices disconnects by itself.
            return await unless_disconnected(request, engine.generate(body))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_STATUS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = await read_json(request, required=True)
        except ProtocolError as exc:
            raise ChatError(exc.message) from None
        return await chat_completions(eng(request), body)

    # ------------------------------------------------------------------ control plane (admin)
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        status, result = await eng(request).update_weights_from_disk(await read_object(request))
        return JSONResponse(result, status_code=status)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        return eng(request).update_weight_version(await read_object(request))

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        return eng(request).pause(await read_object(request))

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, Any]:
        await read_object(request)
        return eng(request).resume()

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        eng(request).abort(await read_object(request))
        return Response(status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation(request: Request) -> JSONResponse:
        await read_json(request, required=False)
        return JSONResponse(None)  # nothing to release on the CPU; SGLang answers 200 null

    for path in UNSUPPORTED_UPDATES:

        async def unsupported(request: Request) -> JSONResponse:
            await read_json(request, required=False)
            return JSONResponse({"success": False, "message": "unsupported on dev engine"}, status_code=400)

        app.add_api_route(path, unsupported, methods=["POST"])

    return app
