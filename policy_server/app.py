"""The policy server app: ``create_app(settings)`` + lifespan wiring of every component.

Role: OpenAI-compatible live proxy in front of the policy engine (or its router) that records
token-exact main turns, pairs them with their next state, judges them asynchronously and serves the
resulting samples to the trainer (docs/CONTRACTS.md "Policy server").

Run: ``hindsight-policy --model-path DIR --engine-url URL --data-dir DIR ...`` (policy_server.cli).

Lifespan: loads the tokenizer, opens the store (SQLite WAL under ``data_dir``, or
the PostgreSQL database of ``--store-url`` shared with other replicas), creates ONE
EngineClient for generation plus one per weight-sync worker (one shared connection pool, built by
engine.http_client.build_async_http with the request-id hook), the judge and
teacher clients and the reward pipeline when configured, reads the engine's current weight_version,
starts the judge dispatcher (which immediately resumes pending work found in the store) and the idle
session sweeper; on shutdown stops both (with the bounded judge drain of policy_server.serving.shutdown) and
closes every client and the store. Lease waiters sleep on a ReadyNotifier that every store write making
a sample ``ready`` feeds (policy_server.store.ready_notifier). Every resource goes on one AsyncExitStack as soon as it exists, so
a setup step that fails closes what the earlier steps opened (runner, clients, store) before re-raising.

PRM scoring (policy_server.rewards.scoring): with ``--prm-config`` the runner is built first
(a broken config or scorer stops the startup with a ``PRMStartupError`` naming the file), its metrics go
on this server's ``/metrics`` registry, the dispatcher scores each accepted turn before storing it
(``--prm-scope turn``) or holds it ``pending_score`` and scores the whole session once it ended
(``--prm-scope session``), and the runner is closed after the dispatcher stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from engine.chat import load_tokenizer
from engine.client import EngineClient, EngineTimeouts, RetryPolicy
from engine.errors import EngineError
from engine.http_client import build_async_http
from engine.http_guard import (
    AdmissionMiddleware,
    BodyLimitMiddleware,
    UnexpectedErrorMiddleware,
)
from engine.observability import (
    RequestContextMiddleware,
    RouteMetrics,
    log_settings,
    propagate_request_id,
)
from engine.records import SampleState as S
from judge_server.client import JudgeClient
from policy_server.api import admin, ops, routes
from policy_server.errors import (
    RETRY_AFTER_S,
    StoreBusy,
    error_body,
    install_error_handlers,
)
from policy_server.metrics import Metrics
from policy_server.rewards.dispatch import Dispatcher
from policy_server.rewards.modes import ModeState, RewardPipeline
from policy_server.rewards.scoring import PRMScoring
from policy_server.serving.generation import Generator, context_length
from policy_server.serving.replicas import ReplicaSync
from policy_server.serving.session_inference import SessionInferrer
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.shutdown import DrainMiddleware, DrainState
from policy_server.serving.weight_sync import WeightGate, WeightSync
from policy_server.settings import PolicySettings
from policy_server.state import PolicyState
from policy_server.store import PostgresStore, SampleStore, Store, sqlite_dir
from policy_server.store.ready_notifier import LocalReadyNotifier

logger = logging.getLogger(__name__)


def _open_store(settings: PolicySettings) -> SampleStore:
    """The SQLite store under the data dir (or the ``sqlite://`` URL's folder), or the shared PostgreSQL one."""
    directory = sqlite_dir(settings.store_url, settings.data_dir)
    if directory is not None:
        return Store(directory, synchronous=settings.store_synchronous, busy_timeout_s=settings.store_busy_timeout_s)
    assert settings.store_url is not None
    return PostgresStore(
        settings.store_url, busy_timeout_s=settings.store_busy_timeout_s, pool_size=settings.store_pool_size
    )


def _build_pipeline(
    settings: PolicySettings,
    tokenizer: Any,
    http: httpx.AsyncClient,
    retry: RetryPolicy,
    stack: contextlib.AsyncExitStack,
) -> tuple[ModeState, RewardPipeline | None]:
    """(mode_state, pipeline or None). The pipeline needs the judge service; its client closes with ``stack``."""
    mode_state = ModeState.from_settings(settings)
    if not settings.judge_url:
        logger.warning("no --judge-url: turns are recorded and stay pending_judge until a judge is configured")
        return mode_state, None
    judge = JudgeClient(settings.judge_url, api_key=settings.judge_api_key)
    stack.push_async_callback(_quiet_close, judge)
    teacher = None
    if settings.teacher_url:
        teacher = EngineClient(settings.teacher_url, api_key=settings.teacher_api_key, http=http, retry=retry)
    pipeline = RewardPipeline(
        judge=judge, teacher=teacher, tokenizer=tokenizer, settings=settings, mode_state=mode_state
    )
    return mode_state, pipeline


async def _quiet_close(closable: Any) -> None:
    try:
        await closable.aclose()
    except Exception:  # shutdown goes on; the failure is logged
        logger.exception("closing %s failed", type(closable).__name__)


async def _stop_background(
    settings: PolicySettings,
    store: SampleStore,
    dispatcher: Dispatcher,
    tasks: list[asyncio.Task[None]],
    sessions: SessionTracker,
) -> None:
    """Graceful part (policy_server.serving.shutdown): chat requests are finished by now; the sweeper stops first (no
    new work), pairings still being written land, then the dispatcher judges for at most shutdown_drain_s and
    what is left stays pending."""
    for task in tasks[1:]:  # the idle sweeper, and the replica sync when there is one
        task.cancel()
    await asyncio.gather(*tasks[1:], return_exceptions=True)
    await sessions.drain_settles()
    drained = await dispatcher.shutdown(settings.shutdown_drain_s)
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    try:
        counts = (await asyncio.to_thread(store.stats))["samples"]
    except StoreBusy as exc:  # the shutdown goes on: everything pending is in the store anyway
        logger.warning(
            "shutdown: %d turn(s) judged while draining; pending counts unknown (%s)", drained["judged"], exc
        )
        return
    logger.info(
        "shutdown: %d turn(s) judged while draining, %d judge call(s) cancelled, %d pending judge job(s) "
        "and %d held sample(s) awaiting session scoring stay in the store for the next start",
        drained["judged"],
        drained["cancelled"],
        counts[S.PENDING_JUDGE],
        counts[S.PENDING_SCORE],
    )


async def _leave(replicas: ReplicaSync) -> None:
    try:
        await replicas.leave()
    except StoreBusy as exc:  # the shutdown goes on: a silent replica stops counting as live after 3 intervals
        logger.warning("shutdown: replica state not cleared: %s", exc)


def _guard_error(status: int, message: str) -> dict[str, object]:
    kind = {413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    return error_body(status, message, kind)


def create_app(settings: PolicySettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Every resource is registered on the stack as soon as it exists, so a failure anywhere in the
        # setup closes exactly what was already opened (in reverse order) before the error propagates;
        # on a normal shutdown the same stack closes everything after the background work stopped.
        async with contextlib.AsyncExitStack() as stack:
            log_settings(logger, settings, title="policy server")
            tokenizer = await asyncio.to_thread(load_tokenizer, settings.model_path)
            # First, so a broken --prm-config fails the startup before anything else is opened.
            try:
                scoring = await PRMScoring.start(settings.prm_config, scope=settings.prm_scope)
            except Exception as exc:
                logger.error("policy server not started: %s", exc)
                raise
            if scoring is not None:  # closed last: after the dispatcher, no scoring is in flight any more
                stack.push_async_callback(scoring.aclose)
            metrics = app.state.metrics
            if scoring is not None:
                scoring.register(metrics.registry)
            store = await asyncio.to_thread(_open_store, settings)
            stack.callback(store.close)
            ready = LocalReadyNotifier()
            store.on_ready = ready.notify  # every write that makes a sample ready wakes the lease waiters
            timeouts = EngineTimeouts()
            retry = RetryPolicy(max_attempts=settings.engine_max_attempts, deadline_s=settings.engine_deadline_s)
            # One pool for every engine call of this process (the engine, its workers, the teacher).
            # The request/session ids of the chat request go upstream with each engine call (observability).
            http = build_async_http(
                timeouts.to_httpx(),
                max_connections=settings.max_concurrent_requests + 16,
                max_keepalive=settings.max_concurrent_requests,
                event_hooks={"request": [propagate_request_id]},
            )
            stack.push_async_callback(http.aclose)
            engine = EngineClient(
                settings.engine_url,
                api_key=settings.engine_api_key,
                admin_api_key=settings.engine_admin_api_key,
                http=http,
                retry=retry,
            )
            workers = [
                EngineClient(
                    u,
                    api_key=settings.engine_api_key,
                    admin_api_key=settings.engine_admin_api_key,
                    http=http,
                    retry=retry,
                )
                for u in settings.engine_worker_urls
            ]
            version = None
            with contextlib.suppress(EngineError):
                version = await workers[0].weight_version()
            gate = WeightGate(settings.gate_timeout_s, version=version)
            mode_state, pipeline = _build_pipeline(settings, tokenizer, http, retry, stack)
            replica_id = settings.replica_id or f"{socket.gethostname()}:{settings.port}:{os.getpid()}"
            replicas = None
            if isinstance(store, PostgresStore):  # other replicas may share this store: follow their admin changes
                replicas = ReplicaSync(
                    store,
                    replica_id=replica_id,
                    mode_state=mode_state,
                    gate=gate,
                    interval_s=settings.idle_sweep_interval_s,
                    max_pause_s=settings.weight_update_deadline_s,
                )
                store.on_admin = replicas.wake
            persisted = await asyncio.to_thread(store.get_runtime, "mode")
            if persisted is not None:  # set through POST /admin/mode before a restart: it stays in force
                mode_state.set(persisted["mode"], persisted["w_rl"], persisted["w_opd"])
                flags = {"mode": settings.mode, "w_rl": settings.w_rl, "w_opd": settings.w_opd}
                if flags != mode_state.to_dict():
                    logger.warning("reward mode %s set through /admin/mode overrides the flags %s", persisted, flags)
            dispatcher = Dispatcher(
                store,
                pipeline,
                concurrency=settings.dispatch_concurrency,
                retry_initial_s=settings.dispatch_retry_initial_s,
                retry_max_s=settings.dispatch_retry_max_s,
                scoring=scoring,
                # one process on SQLite: nobody to share the work with, no claims needed
                owner=replica_id if replicas is not None else None,
                claim_s=settings.dispatch_claim_s,
            )
            sessions = SessionTracker(
                store,
                idle_timeout_s=settings.session_idle_timeout_s,
                sweep_interval_s=settings.idle_sweep_interval_s,
                on_new_work=dispatcher.wake,
            )
            if replicas is not None:  # the sweep also spares sessions in flight at other replicas, and vice versa
                sessions.remote_in_flight = replicas.remote_in_flight
                replicas.in_flight = sessions.in_flight_sessions
            state = PolicyState(
                settings=settings,
                store=store,
                engine=engine,
                generator=await asyncio.to_thread(
                    Generator,
                    engine,
                    tokenizer,
                    gate,
                    max_resumes=settings.max_resumes,
                    max_prompt_tokens=settings.max_prompt_tokens or context_length(settings.model_path),
                ),
                gate=gate,
                weight_sync=WeightSync(
                    workers,
                    gate,
                    pause_mode=settings.pause_mode,
                    deadline_s=settings.weight_update_deadline_s,
                    replicas=replicas,
                ),
                sessions=sessions,
                dispatcher=dispatcher,
                metrics=metrics,
                mode_state=mode_state,
                pipeline=pipeline,
                backlog_cache=[0.0, -1e9],
                scoring=scoring,
                ready=ready,
                inferrer=SessionInferrer(store, sessions, metrics) if settings.infer_sessions else None,
            )
            tasks = [
                asyncio.create_task(dispatcher.run(), name="dispatcher"),
                asyncio.create_task(sessions.run_sweeper(), name="idle-sweeper"),
            ]
            if replicas is not None:
                await replicas.refresh()  # a mode or pause set at another replica holds from the first request
                tasks.append(asyncio.create_task(replicas.run(), name="replica-sync"))
                stack.push_async_callback(_leave, replicas)  # runs after the background tasks stopped
            stack.push_async_callback(_stop_background, settings, store, dispatcher, tasks, sessions)
            counts = (await asyncio.to_thread(store.stats))["samples"]
            app.state.policy = state
            logger.info(
                "policy server ready: engine %s, weight_version %s, %d pending judge job(s) and %d held "
                "sample(s) awaiting session scoring resumed",
                settings.engine_url,
                version,
                counts[S.PENDING_JUDGE],
                counts[S.PENDING_SCORE],
            )
            if counts[S.PENDING_SCORE] and scoring is None:
                logger.warning(
                    "%d sample(s) are held pending_score for session PRM scoring, but PRM scoring is off: "
                    "they stay held (not leasable) until the server runs with --prm-config again",
                    counts[S.PENDING_SCORE],
                )
            yield

    app = FastAPI(title="hindsight-policy", lifespan=lifespan)
    app.state.settings = settings
    app.state.drain = DrainState()
    app.state.metrics = Metrics()
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    # Hostile-input guards (engine.http_guard): body size while reading, before any route or auth runs;
    # then admission (bounded in-flight requests, 429 beyond) around it, so a flood is refused unread.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, error_body=_guard_error)
    app.add_middleware(
        AdmissionMiddleware,
        max_in_flight=settings.max_concurrent_requests,
        error_body=_guard_error,
        retry_after_s=RETRY_AFTER_S,
    )
    app.add_middleware(
        UnexpectedErrorMiddleware,
        logger=logger,
        error_body=lambda status, msg: error_body(status, msg, "internal_error"),
    )
    # Added last, so outermost: request/session ids, access line and route metrics for every response,
    # the drain 503s included (engine.observability).
    app.add_middleware(
        RequestContextMiddleware, route_metrics=RouteMetrics(app.state.metrics.registry, prefix="hindsight_policy")
    )
    install_error_handlers(app)
    app.include_router(routes.router)
    app.include_router(ops.router)
    app.include_router(admin.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, corrected to what the server answers: a request validation error is a 400 in
    OpenAI's error shape here (policy_server.errors), not FastAPI's 422."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        from policy_server.api.openai_schemas import ErrorResponse

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = (
            ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        )
        error_ref = {
            "description": "invalid request (names the field)",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", error_ref)
        app.openapi_schema = schema
    return app.openapi_schema
