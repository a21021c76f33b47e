"""Operational routes: ``/v1/models`` (client key), ``/health`` (liveness), ``/ready`` (readiness, 503 until
the engine answers and the store can write, and while draining) and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from policy_server.api import model_names
from policy_server.api.auth import is_admin, require_client
from policy_server.api.response_models import Health, ModelCard, ModelList, Ready, ok
from policy_server.api.route_docs import error_responses
from policy_server.state import PolicyState

router = APIRouter()


def _state(request: Request) -> PolicyState:
    return request.app.state.policy


@router.get("/v1/models", response_model=ModelList, responses={**ok(ModelList), **error_responses(401)})
async def models(request: Request) -> ModelList:
    """Every model name this server answers to (the served name, then its aliases)."""
    st = _state(request)
    require_client(request, st.settings)
    created = request.app.state.started_at_s
    return ModelList(
        object="list",
        data=[
            model_names.model_card(st.settings, name, created, st.gate.version, st.generator.family)
            for name in model_names.served_models(st.settings)
        ],
    )


@router.get(
    "/v1/models/{model_id:path}", response_model=ModelCard, responses={**ok(ModelCard), **error_responses(401, 404)}
)
async def model(request: Request, model_id: str) -> ModelCard:
    """One model name of :func:`models`; any other is a 404 ``model_not_found``."""
    st = _state(request)
    require_client(request, st.settings)
    model_names.check_model(st.settings, model_id)
    return model_names.model_card(
        st.settings, model_id, request.app.state.started_at_s, st.gate.version, st.generator.family
    )


@router.get("/health", response_model=Health, responses=ok(Health))
async def health() -> Health:
    return Health(status="ok")


@router.get(
    "/ready",
    response_model=Ready,
    response_model_exclude_unset=True,  # the detail fields are set only for the admin key's holder
    responses={
        **ok(Ready, "ready (same body as the 503)"),
        503: {"model": Ready, "description": "engine down, store busy or draining"},
    },
)
async def ready(request: Request, response: Response) -> Ready:
    """200 when the engine answers, the store can start a write now and the server is not draining, else 503.
    Anyone sees the three checks; the detail (engine URL, weight version, gate, why the store is busy) only
    the admin key's holder."""
    st = _state(request)
    draining = request.app.state.drain.draining
    engine_ok = await st.engine.health(timeout_s=2.0)
    store_problem = await asyncio.to_thread(st.store.probe, min(0.5, st.settings.store_busy_timeout_s))
    ok = not draining and engine_ok and store_problem is None
    body = Ready(ready=ok, engine=engine_ok, store=store_problem is None, draining=draining)
    if is_admin(request, st.settings):  # set only here (exclude_unset): only the admin's body has them
        body.engine_url = st.settings.engine_url
        body.weight_version = st.gate.version
        body.gate_open = st.gate.is_open
        body.judge = bool(st.pipeline)
        body.store_detail = store_problem
    if not ok:
        response.status_code = 503
        response.headers["Retry-After"] = "5"
    return body


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain; version=0.0.4": {}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    st = _state(request)
    st.metrics.gate_waiting.set(st.gate.waiting)
    stats = await asyncio.to_thread(st.store.stats)
    await st.metrics.refresh_judge_feedback(lambda: st.store.judge_agreement(st.settings.feedback_agreement_window))
    return Response(st.metrics.render(stats), media_type="text/plain; version=0.0.4")
