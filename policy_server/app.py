"""The policy server app: ``create_app(settings)`` + lifespan wiring of every component.

Role: OpenAI-compatible live proxy in front of the policy engine (or its router) that records
token-exact main turns, pairs them with their next state, judges them asynchronously and serves the
resulting samples to the trainer (docs/CONTRACTS.md "Policy server").

Run: ``hindsight-policy --model-path DIR --engine-url URL --data-dir DIR ...`` (policy_server.cli).

Lifespan (each step a function of policy_server.components): loads the tokenizer, opens the store (SQLite WAL under ``data_dir``, or
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
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from engine.chat import load_tokenizer
from engine.chat_families import resolve_family
from engine.errors import EngineError
from engine.http_guard import (
    AdmissionMiddleware,
    BodyLimitMiddleware,
    UnexpectedErrorMiddleware,
)
from engine.observability import (
    RequestContextMiddleware,
    RouteMetrics,
    log_settings,
)
from policy_server import components
from policy_server.api import admin, feedback, lease, ops, weights
from policy_server.api import sessions as sessions_routes
from policy_server.api.chat import routes as chat_routes
from policy_server.api.messages import routes as messages_routes
from policy_server.api.messages import shapes as messages_shapes
from policy_server.api.responses import routes as responses_routes
from policy_server.errors import (
    RETRY_AFTER_S,
    ErrorShapeMiddleware,
    error_body,
    install_error_handlers,
)
from policy_server.metrics import Metrics
from policy_server.rewards.dispatch import Dispatcher
from policy_server.rewards.scoring import PRMScoring
from policy_server.serving.deletion_tokens import DeletionTokens
from policy_server.serving.generation import Generator
from policy_server.serving.identity import SessionResolver
from policy_server.serving.prompt_size import context_length
from policy_server.serving.retention import run_retention
from policy_server.serving.secrets import SecretScanner
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.shutdown import DrainMiddleware, DrainState
from policy_server.serving.side_rules import SideRules
from policy_server.serving.weight_sync import WeightGate, WeightSync
from policy_server.settings import PolicySettings
from policy_server.state import PolicyState
from policy_server.store.ready_notifier import LocalReadyNotifier

logger = logging.getLogger(__name__)


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
            if settings.chat_template is not None:
                tokenizer.chat_template = await asyncio.to_thread(Path(settings.chat_template).read_text)
            family = resolve_family(tokenizer, settings.tool_call_parser, settings.reasoning_parser)
            logger.info(
                "chat format: history=%s tool_call_parser=%s reasoning_parser=%s tool_call_ids=%s reasoning_switch=%s",
                settings.history,
                family.tool_call_parser,
                family.reasoning_parser,
                family.id_form,
                family.reasoning_switch,
            )
            # First, so a broken --side-rules-file or --prm-config fails the startup before anything else is opened.
            try:
                side_rules = SideRules.load(settings.side_rules_file)
                secrets = SecretScanner(settings.secret_patterns_path)
                scoring = await PRMScoring.start(settings.prm_config, scope=settings.prm_scope)
            except Exception as exc:
                logger.error("policy server not started: %s", exc)
                raise
            if scoring is not None:  # closed last: after the dispatcher, no scoring is in flight any more
                stack.push_async_callback(scoring.aclose)
            metrics = app.state.metrics
            if scoring is not None:
                scoring.register(metrics.registry)
            store = await asyncio.to_thread(components.open_store, settings)
            stack.callback(store.close)
            ready = LocalReadyNotifier()
            store.on_ready = ready.notify  # every write that makes a sample ready wakes the lease waiters
            http, retry = components.engine_pool(settings, stack)
            engine = components.engine_client(settings, settings.engine_url, http, retry)
            workers = [components.engine_client(settings, url, http, retry) for url in settings.engine_worker_urls]
            version = None
            with contextlib.suppress(EngineError):
                version = await workers[0].weight_version()
            gate = WeightGate(settings.gate_timeout_s, version=version)
            mode_state, pipeline = components.build_pipeline(settings, tokenizer, http, retry, stack)
            replica_id = settings.replica_id or f"{socket.gethostname()}:{settings.port}:{os.getpid()}"
            replicas = components.replica_sync(settings, store, replica_id, mode_state, gate)
            await components.restore_mode(settings, store, mode_state)
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
                feedback_policy=settings.feedback_policy,
                feedback_hint=settings.feedback_hint,
                at_least_one=settings.at_least_one,
            )
            sessions = SessionTracker(
                store,
                idle_timeout_s=settings.session_idle_timeout_s,
                sweep_interval_s=settings.idle_sweep_interval_s,
                on_new_work=dispatcher.wake,
            )
            sessions.side_rules = side_rules
            if replicas is not None:  # the sweep also spares sessions in flight at other replicas, and vice versa
                sessions.remote_in_flight = replicas.remote_in_flight
                replicas.in_flight = sessions.in_flight_sessions
            resolver = SessionResolver(
                store, sessions, metrics, infer=settings.infer_sessions, split_diverged=settings.split_diverged_sessions
            )
            # The Responses API's previous_response_id names the session of the stored answer it continues.
            resolver.previous_response_session = lambda rid: asyncio.to_thread(store.response_session, rid)
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
                    render_verify_tokens_per_turn=settings.render_verify_tokens_per_turn,
                    render_concurrency=settings.render_concurrency,
                    history=settings.history,
                    family=family,
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
                resolver=resolver,
                side_rules=side_rules,
                secrets=secrets,
                deletion_tokens=DeletionTokens(await asyncio.to_thread(store.deletion_key)),
            )
            state.versions, state.canary = await components.version_control(settings, store, state.weight_sync, metrics)
            await components.start_background(stack, settings, store, dispatcher, sessions, replicas, state.canary)
            retention = asyncio.create_task(run_retention(store, settings, metrics), name="retention")
            stack.callback(retention.cancel)
            app.state.policy = state
            await components.log_resumed_work(settings, store, version, scoring)
            yield

    app = FastAPI(title="hindsight-policy", lifespan=lifespan)
    app.state.settings = settings
    app.state.started_at_s = int(time.time())  # the "created" of the models it serves
    app.state.drain = DrainState()
    app.state.metrics = Metrics()
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    # Hostile-input guards (engine.http_guard): body size while reading, before any route or auth runs;
    # then admission (bounded in-flight requests, 429 beyond) around it, so a flood is refused unread.
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, error_body=_guard_error, require_json=True
    )
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
    # Around every guard above, so their 413/415/429/500/503 leave the Messages routes in Anthropic's shape too.
    app.add_middleware(ErrorShapeMiddleware, shapes={messages_routes.MESSAGES_PATH: messages_shapes.error_body})
    # Added last, so outermost: request/session ids, access line and route metrics for every response,
    # the drain 503s included (engine.observability).
    app.add_middleware(
        RequestContextMiddleware, route_metrics=RouteMetrics(app.state.metrics.registry, prefix="hindsight_policy")
    )
    install_error_handlers(app)
    app.include_router(chat_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(messages_routes.router)
    app.include_router(ops.router)
    app.include_router(lease.router)
    app.include_router(admin.router)
    app.include_router(weights.router)
    app.include_router(feedback.router)
    app.include_router(sessions_routes.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, corrected to what the server answers: a request validation error is a 400 in
    OpenAI's error shape here (policy_server.errors), not FastAPI's 422; the lease limits are this server's."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        from policy_server.api.route_docs import ErrorResponse

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
        settings: PolicySettings = app.state.settings
        lease.declare_limits(schema, settings.max_lease_size, settings.max_lease_wait_s)
        app.openapi_schema = schema
    return app.openapi_schema
