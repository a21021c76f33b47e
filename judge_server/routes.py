"""HTTP routes of the judge service (thin: validate, delegate to JudgeService, shape the answer).

- ``POST /v1/judge`` -> one result (docs/CONTRACTS.md). Always 200 once the input is valid: an engine
  failure is reported per task as ``status: judge_failed`` with ``score: null``.
- ``POST /v1/judge/batch`` ``{"items": [...]}`` (or a bare list) -> ``{"results": [...]}``, judged
  concurrently, one result per item in order, each with its own statuses.
- ``POST /get_reward`` (OpenRLHF) and ``POST /slime/reward`` (slime rm-url): see compat.py.
- ``GET /health`` liveness; ``GET /ready`` judge engine reachable (503 otherwise); ``GET /metrics``.
Bearer ``api_key`` guards the POST routes when configured. Oversized input -> 413, bad input -> 400/422.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from engine.errors import EngineError, EngineRejected
from judge_server.compat import openrlhf_items, slime_item
from judge_server.errors import InvalidRequest, Unauthorized
from judge_server.judge import JudgeService
from judge_server.schemas import BatchRequest, JudgeRequest, OpenRLHFRequest, SlimeRequest
from judge_server.voting import STATUS_FAILED

router = APIRouter()


async def require_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized("missing or invalid Bearer API key")


async def check_size(request: Request) -> None:
    limit = request.app.state.settings.max_request_chars
    body = await request.body()
    if len(body) > limit:
        raise InvalidRequest(f"request body of {len(body)} bytes exceeds the limit of {limit}", status_code=413)


def _check_item(service: JudgeService, item: JudgeRequest) -> None:
    limit = service.settings.max_context_messages
    if len(item.context) > limit:
        raise InvalidRequest(f"context has {len(item.context)} messages, limit {limit}", status_code=413)
    if item.m is not None and item.m > service.settings.max_m:
        raise InvalidRequest(f"m={item.m} exceeds the maximum of {service.settings.max_m}")


def _service(request: Request) -> JudgeService:
    return request.app.state.judge


guarded = [Depends(require_key), Depends(check_size)]


@router.post("/v1/judge", dependencies=guarded)
async def judge_one(item: JudgeRequest, request: Request) -> dict[str, Any]:
    service = _service(request)
    _check_item(service, item)
    return await service.judge(item)


@router.post("/v1/judge/batch", dependencies=guarded)
async def judge_batch(body: BatchRequest | list[JudgeRequest], request: Request) -> dict[str, Any]:
    service = _service(request)
    items = body.items if isinstance(body, BatchRequest) else body
    if not items:
        raise InvalidRequest("batch is empty")
    if len(items) > service.settings.max_batch_items:
        raise InvalidRequest(f"batch of {len(items)} exceeds {service.settings.max_batch_items} items", 413)
    for item in items:
        _check_item(service, item)
    return {"results": list(await asyncio.gather(*(service.judge(i) for i in items)))}


@router.post("/get_reward", dependencies=guarded)
async def openrlhf_reward(body: OpenRLHFRequest, request: Request) -> dict[str, Any]:
    service = _service(request)
    items = openrlhf_items(body.query, body.prompts, body.labels)
    if len(items) > service.settings.max_batch_items:
        raise InvalidRequest(f"batch of {len(items)} exceeds {service.settings.max_batch_items} items", 413)
    for item in items:
        _check_item(service, item)
    results = await asyncio.gather(*(service.judge(i) for i in items))
    rewards = [None if r["prm"]["status"] == STATUS_FAILED else float(r["prm"]["score"]) for r in results]
    return {"rewards": rewards, "scores": list(rewards),
            "extra_logs": {"status": [r["prm"]["status"] for r in results],
                           "confidence": [r["prm"]["confidence"] for r in results]}}


@router.post("/slime/reward", dependencies=guarded)
async def slime_reward(body: SlimeRequest, request: Request) -> JSONResponse:
    service = _service(request)
    item = slime_item(body.prompt, body.response, body.label)
    _check_item(service, item)
    result = await service.judge(item)
    prm = result["prm"]
    if prm["status"] == STATUS_FAILED:
        return JSONResponse({"error": {"type": "JudgeFailed", "message": prm["reason"]}, "prm": prm},
                            status_code=503)
    return JSONResponse({"reward": float(prm["score"]), "status": prm["status"], "prm": prm,
                         "prompt_versions": result["prompt_versions"]})


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


async def _engine_ready(service: JudgeService) -> bool:
    client = service.client
    if client is None:
        return True
    try:
        await client.request("GET", "/readiness", retry=False, deadline_s=2.0)  # sglang-router
        return True
    except EngineRejected as exc:
        if exc.status_code == 404:  # a plain engine has no /readiness
            return await client.health("/health", timeout_s=2.0)
        return False
    except EngineError:
        return False


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    service = _service(request)
    ok = await _engine_ready(service)
    body = {"ready": ok, "backend": service.settings.backend, "prompt_versions": service.prompt_versions,
            "tokenizer_path": request.app.state.tokenizer_path,
            "engine_url": service.settings.engine_url if service.settings.backend == "llm" else None}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")

