"""HTTP routes of the judge service (thin: validate, delegate to JudgeService, shape the answer).

- ``POST /v1/judge`` -> one result (docs/CONTRACTS.md). Always 200 once the input is valid: an engine
  failure is reported per task as ``status: judge_failed`` with ``score: null``.
- ``POST /v1/judge/batch`` ``{"items": [...]}`` (or a bare list) -> ``{"results": [...]}``, judged
  concurrently, one result per item in order, each with its own statuses.
- ``POST /get_reward`` (OpenRLHF) and ``POST /slime/reward`` (slime rm-url): see compat.py.
- ``GET /health`` liveness; ``GET /ready`` judge engine reachable (backend openai: ``GET /v1/models``) (503 otherwise; backend, prompt versions,
  the guard configuration, tokenizer path and engine URL only with the API key); ``GET /metrics``.
Bearer ``api_key`` guards the POST routes when configured (engine.auth, constant time). The two reward-client routes also take it as
the URL query parameter ``api_key`` (those clients can only be given a URL, never a header); the query
string is never logged (engine.observability), and metrics carry route templates only.
Oversized input -> 413, bad input -> 400/422.

Caller disconnects (a caller that leaves must not keep engine work running): every judging route
runs its work as a task next to a watcher of the ASGI ``receive`` channel. The body has been read in full
by then, so the next message is ``http.disconnect``, which uvicorn delivers as soon as the caller's socket
closes (uvicorn never cancels a handler by itself). When the caller leaves first, the work is cancelled
(every in-flight voting round with it, closing their engine connections) and
``JudgeService.abort(rid_prefix)`` aborts the engine requests of this HTTP request by rid prefix
(``hj-<32 hex>-``; best effort, see judge_server.judge for routers); the answer is a 499 nobody reads.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import PlainTextResponse

from engine.auth import bearer_problem, key_matches
from engine.disconnect import CLIENT_CLOSED_STATUS, ClientGone, unless_disconnected
from engine.errors import EngineError, EngineRejected
from engine.records import JudgeVerdicts
from judge_server.compat import openrlhf_items, openrlhf_reply, slime_item, slime_reply
from judge_server.errors import InvalidRequest, Unauthorized
from judge_server.judge import JudgeService
from judge_server.schemas import (
    BatchRequest,
    JudgeBatchVerdicts,
    JudgeHealth,
    JudgeReady,
    JudgeRequest,
    OpenRLHFRequest,
    OpenRLHFRewards,
    SlimeRequest,
    SlimeReward,
)

logger = logging.getLogger(__name__)
_ERROR = {
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["type", "message"],
                        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                    }
                },
            }
        }
    }
}
# What the judging routes answer besides 200/422 (documented so the OpenAPI matches the server).
JUDGE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid input (JSON too deep, unpaired surrogates, m too large, empty batch)", **_ERROR},
    401: {"description": "missing or wrong Bearer key", **_ERROR},
    413: {"description": "body over max_request_chars, or too many items/messages", **_ERROR},
    415: {"description": "Content-Type is not JSON", **_ERROR},
    429: {"description": "too many requests in flight (Retry-After)", **_ERROR},
}
router = APIRouter()
T = TypeVar("T")


def has_key(request: Request) -> bool:
    """Whether the request carries the Bearer ``api_key`` (True when none is configured); constant time."""
    return bearer_problem(request.headers.get("authorization"), request.app.state.settings.api_key) is None


async def require_key(request: Request) -> None:
    if not has_key(request):
        raise Unauthorized("missing or invalid Bearer API key")


async def require_key_or_query_key(request: Request) -> None:
    """Reward-client routes only: the Bearer header, else the ``api_key`` URL query parameter."""
    key = request.app.state.settings.api_key
    query_key = request.query_params.get("api_key")
    if not key or "authorization" in request.headers or query_key is None:
        await require_key(request)
        return
    if not key_matches(query_key, key):
        raise Unauthorized("missing or invalid API key (Bearer header or api_key query parameter)")


def _check_item(service: JudgeService, item: JudgeRequest) -> None:
    limit = service.settings.max_context_messages
    if len(item.context) > limit:
        raise InvalidRequest(f"context has {len(item.context)} messages, limit {limit}", status_code=413)
    if item.m is not None and item.m > service.settings.max_m:
        raise InvalidRequest(f"m={item.m} exceeds the maximum of {service.settings.max_m}")


def _service(request: Request) -> JudgeService:
    return request.app.state.judge


# The body's size (max_request_chars, in characters) was bounded before any route, while it was read:
# engine.http_guard.BodyLimitMiddleware is the one place that rule lives.
guarded = [Depends(require_key)]
compat_guarded = [Depends(require_key_or_query_key)]


async def _unless_disconnected(
    request: Request, service: JudgeService, work: Callable[[str], Coroutine[Any, Any, T]]
) -> T | Response:
    """Run ``work(rid_prefix)``; if the caller hangs up first, cancel it, abort its engine requests, 499."""
    rid_prefix = f"hj-{uuid.uuid4().hex}-"
    try:
        return await unless_disconnected(request, work(rid_prefix))
    except ClientGone:
        logger.info("caller disconnected; judge rounds %s* cancelled", rid_prefix)
        await asyncio.shield(service.abort(rid_prefix))
        return Response(status_code=CLIENT_CLOSED_STATUS)


async def _judge_all(service: JudgeService, items: list[JudgeRequest], rid_prefix: str) -> list[JudgeVerdicts]:
    # One prefix per HTTP request, one sub-prefix per item: a single abort covers the whole batch.
    return list(await asyncio.gather(*(service.judge(it, f"{rid_prefix}{i}-") for i, it in enumerate(items))))


# The verdict records are the bodies: an unrequested task (never set) stays absent, as the records' wire contract says.
@router.post(
    "/v1/judge",
    dependencies=guarded,
    response_model=JudgeVerdicts,
    response_model_exclude_unset=True,
    responses={200: {"description": "the verdicts"}, **JUDGE_ERRORS},
)
async def judge_one(item: JudgeRequest, request: Request) -> JudgeVerdicts | Response:
    service = _service(request)
    _check_item(service, item)
    return await _unless_disconnected(request, service, lambda rid: service.judge(item, rid))


@router.post(
    "/v1/judge/batch",
    dependencies=guarded,
    response_model=JudgeBatchVerdicts,
    response_model_exclude_unset=True,
    responses={200: {"description": "one verdict per item, in order"}, **JUDGE_ERRORS},
)
async def judge_batch(body: BatchRequest | list[JudgeRequest], request: Request) -> JudgeBatchVerdicts | Response:
    service = _service(request)
    items = body.items if isinstance(body, BatchRequest) else body
    if not items:
        raise InvalidRequest("batch is empty")
    if len(items) > service.settings.max_batch_items:
        raise InvalidRequest(f"batch of {len(items)} exceeds {service.settings.max_batch_items} items", 413)
    for item in items:
        _check_item(service, item)
    results = await _unless_disconnected(request, service, lambda rid: _judge_all(service, items, rid))
    return results if isinstance(results, Response) else JudgeBatchVerdicts(results=results)


# The reward of a judge_failed item, per request: the URL is all OpenRLHF and slime let a user configure.
FAILED_REWARD = Query(
    None,
    allow_inf_nan=False,
    description="reward of a judge_failed item for this request (default: --compat-failed-reward, else 503)",
)


def _failed_reward(service: JudgeService, from_url: float | None) -> float | None:
    return from_url if from_url is not None else service.settings.compat_failed_reward


@router.post(
    "/get_reward",
    dependencies=compat_guarded,
    response_model=OpenRLHFRewards,
    responses={
        200: {"model": OpenRLHFRewards, "description": "one reward per query"},
        **JUDGE_ERRORS,
        503: {"description": "judging failed (no reward)", **_ERROR},
    },
)
async def openrlhf_reward(
    body: OpenRLHFRequest, request: Request, failed_reward: float | None = FAILED_REWARD
) -> OpenRLHFRewards | Response:
    service = _service(request)
    items = openrlhf_items(body.query, body.prompts, body.labels)
    if len(items) > service.settings.max_batch_items:
        raise InvalidRequest(f"batch of {len(items)} exceeds {service.settings.max_batch_items} items", 413)
    for item in items:
        _check_item(service, item)
    results = await _unless_disconnected(request, service, lambda rid: _judge_all(service, items, rid))
    if isinstance(results, Response):
        return results
    return openrlhf_reply(results, _failed_reward(service, failed_reward))


@router.post(
    "/slime/reward",
    dependencies=compat_guarded,
    response_model=SlimeReward,
    response_model_exclude_unset=True,  # the verdict travels as its JSON (absent keys stay absent)
    responses={
        200: {"model": SlimeReward, "description": "the reward and its verdict"},
        **JUDGE_ERRORS,
        503: {"description": "judging failed (no reward)", **_ERROR},
    },
)
async def slime_reward(
    body: SlimeRequest, request: Request, failed_reward: float | None = FAILED_REWARD
) -> SlimeReward | Response:
    service = _service(request)
    item = slime_item(body.prompt, body.response, body.label)
    _check_item(service, item)
    result = await _unless_disconnected(request, service, lambda rid: service.judge(item, rid))
    if isinstance(result, Response):
        return result
    return slime_reply(result, _failed_reward(service, failed_reward))


@router.get("/health", response_model=JudgeHealth, responses={200: {"model": JudgeHealth, "description": "alive"}})
async def health() -> JudgeHealth:
    return JudgeHealth(status="ok")


async def _engine_ready(service: JudgeService) -> bool:
    client = service.client
    if client is None:
        return True
    if service.settings.backend == "openai":  # every OpenAI-compatible server lists its models
        try:
            await client.request("GET", "/v1/models", retry=False, deadline_s=2.0)
            return True
        except EngineError:
            return False
    try:
        await client.request("GET", "/readiness", retry=False, deadline_s=2.0)  # sglang-router
        return True
    except EngineRejected as exc:
        if exc.status_code == 404:  # a plain engine has no /readiness
            return await client.health("/health", timeout_s=2.0)
        return False
    except EngineError:
        return False


@router.get(
    "/ready",
    response_model=JudgeReady,
    response_model_exclude_unset=True,  # the detail fields are set only for the key's holder
    responses={
        200: {"model": JudgeReady, "description": "the judge engine answers"},
        503: {"model": JudgeReady, "description": "judge engine unreachable"},
    },
)
async def ready(request: Request, response: Response) -> JudgeReady:
    service = _service(request)
    ok = await _engine_ready(service)
    body = JudgeReady(ready=ok)
    if has_key(request):  # paths and URLs only for the key's holder (open when no key is configured)
        body.backend = service.settings.backend
        body.prompt_versions = service.prompt_versions
        body.guards = service.settings.guards
        body.tokenizer_path = request.app.state.tokenizer_path
        body.engine_url = {"llm": service.settings.engine_url, "openai": service.settings.base_url}.get(
            service.settings.backend
        )
    if not ok:
        response.status_code = 503
    return body


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain; version=0.0.4": {}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")
