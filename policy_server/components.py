"""The policy server's components, built and stopped in the order the app's lifespan runs them.

Each function is one named step of ``policy_server.app``'s lifespan: open the store, build the engine pool and
clients, the reward pipeline, the replica sync (PostgreSQL only), restore the reward mode set through the admin
API, start the background work (dispatcher, idle sweeper, replica sync) and, on shutdown, stop it gracefully
(sweeper first, pending pairings written, the dispatcher drained for a bounded time). Every resource is
registered on the lifespan's AsyncExitStack by the step that opens it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from engine.client import EngineClient, EngineTimeouts, RetryPolicy
from engine.http_client import build_async_http
from engine.observability import (
    propagate_request_id,
)
from engine.records import ModeSnapshot
from engine.records import SampleState as S
from judge_server.client import JudgeClient
from policy_server.errors import (
    StoreBusy,
)
from policy_server.metrics import Metrics
from policy_server.rewards.dispatch import Dispatcher
from policy_server.rewards.modes import ModeState, RewardPipeline
from policy_server.rewards.scoring import PRMScoring
from policy_server.serving.canary import Canary, CanaryPolicy
from policy_server.serving.replicas import ReplicaSync
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.versions import VersionControl
from policy_server.serving.weight_sync import WeightGate, WeightSync
from policy_server.settings import PolicySettings
from policy_server.store import PostgresStore, SampleStore, Store, sqlite_dir

logger = logging.getLogger(__name__)


def open_store(settings: PolicySettings) -> SampleStore:
    """The SQLite store under the data dir (or the ``sqlite://`` URL's folder), or the shared PostgreSQL one."""
    directory = sqlite_dir(settings.store_url, settings.data_dir)
    if directory is not None:
        return Store(directory, synchronous=settings.store_synchronous, busy_timeout_s=settings.store_busy_timeout_s)
    assert settings.store_url is not None
    return PostgresStore(
        settings.store_url, busy_timeout_s=settings.store_busy_timeout_s, pool_size=settings.store_pool_size
    )


def build_pipeline(
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
    stack.push_async_callback(quiet_close, judge)
    teacher = None
    if settings.teacher_url:
        teacher = EngineClient(settings.teacher_url, api_key=settings.teacher_api_key, http=http, retry=retry)
    elif settings.mode != "rl":  # a persisted /admin/mode may differ; no_teacher rejections say it per turn
        logger.warning("--mode %s without --teacher-url: its turns are rejected no_teacher", settings.mode)
    pipeline = RewardPipeline(
        judge=judge, teacher=teacher, tokenizer=tokenizer, settings=settings, mode_state=mode_state
    )
    return mode_state, pipeline


async def quiet_close(closable: Any) -> None:
    try:
        await closable.aclose()
    except Exception:  # shutdown goes on; the failure is logged
        logger.exception("closing %s failed", type(closable).__name__)


async def stop_background(
    settings: PolicySettings,
    store: SampleStore,
    dispatcher: Dispatcher,
    tasks: list[asyncio.Task[None]],
    sessions: SessionTracker,
) -> None:
    """Graceful part (policy_server.serving.shutdown): chat requests are finished by now; the sweeper stops first (no
    new work), pairings still being written land, then the dispatcher judges for at most shutdown_drain_s and
    what is left stays pending."""
    for task in tasks[1:]:  # the idle sweeper, the replica sync and the canary test when there are
        task.cancel()
    await asyncio.gather(*tasks[1:], return_exceptions=True)
    await sessions.drain_settles()
    drained = await dispatcher.shutdown(settings.shutdown_drain_s)
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    try:
        counts = (await asyncio.to_thread(store.stats)).samples
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


async def leave(replicas: ReplicaSync) -> None:
    try:
        await replicas.leave()
    except StoreBusy as exc:  # the shutdown goes on: a silent replica stops counting as live after 3 intervals
        logger.warning("shutdown: replica state not cleared: %s", exc)


def engine_pool(settings: PolicySettings, stack: contextlib.AsyncExitStack) -> tuple[httpx.AsyncClient, RetryPolicy]:
    """One pool for every engine call of this process (the engine, its workers, the teacher), closed with ``stack``;
    the request/session ids of the chat request go upstream with each engine call (observability)."""
    http = build_async_http(
        EngineTimeouts().to_httpx(),
        max_connections=settings.max_concurrent_requests + 16,
        max_keepalive=settings.max_concurrent_requests,
        event_hooks={"request": [propagate_request_id]},
    )
    stack.push_async_callback(http.aclose)
    return http, RetryPolicy(max_attempts=settings.engine_max_attempts, deadline_s=settings.engine_deadline_s)


def engine_client(settings: PolicySettings, url: str, http: httpx.AsyncClient, retry: RetryPolicy) -> EngineClient:
    return EngineClient(
        url, api_key=settings.engine_api_key, admin_api_key=settings.engine_admin_api_key, http=http, retry=retry
    )


def replica_sync(
    settings: PolicySettings, store: SampleStore, replica_id: str, mode_state: ModeState, gate: WeightGate
) -> ReplicaSync | None:
    """On PostgreSQL other replicas may share the store: follow their admin changes (None on SQLite)."""
    if not isinstance(store, PostgresStore):
        return None
    replicas = ReplicaSync(
        store,
        replica_id=replica_id,
        mode_state=mode_state,
        gate=gate,
        interval_s=settings.idle_sweep_interval_s,
        max_pause_s=settings.weight_update_deadline_s,
    )
    store.on_admin = replicas.wake
    return replicas


async def version_control(
    settings: PolicySettings, store: SampleStore, weight_sync: WeightSync, metrics: Metrics
) -> tuple[VersionControl, Canary | None]:
    """The weight-version ledger's control (the engines' startup weights recorded live, with ``--model-path`` as
    their checkpoint) and, with ``--safe-updates``, the canary: on the last worker when there are two or more."""
    workers = weight_sync.workers
    canary_workers = workers[-1:] if settings.safe_updates and len(workers) >= 2 else []
    control = VersionControl(store, weight_sync, safe_updates=settings.safe_updates, canary_workers=canary_workers)
    control.on_state = lambda current: setattr(metrics.versions, "current", current)
    await control.start(checkpoint=settings.model_path)
    if not settings.safe_updates:
        return control, None
    policy = CanaryPolicy(
        share=settings.canary_share,
        alpha=settings.canary_alpha,
        margin=settings.canary_margin,
        min_sessions=settings.canary_min_sessions,
        max_sessions=settings.canary_max_sessions,
        reference_sessions=settings.canary_reference_sessions,
        check_interval_s=settings.canary_check_interval_s,
        drain_s=settings.canary_drain_s,
        session_idle_s=settings.session_idle_timeout_s,
    )
    canary = Canary(store, control, policy, metrics)
    control.after_change = canary.refresh
    await canary.refresh()
    return control, canary


async def restore_mode(settings: PolicySettings, store: SampleStore, mode_state: ModeState) -> None:
    """A mode set through ``POST /admin/mode`` before a restart stays in force over the flags."""
    persisted = await asyncio.to_thread(store.get_runtime, "mode", ModeSnapshot)
    if persisted is None:
        return
    mode_state.set(persisted.mode, persisted.w_rl, persisted.w_opd)
    flags = ModeState.from_settings(settings).snapshot()
    if flags != mode_state.snapshot():
        logger.warning("reward mode %s set through /admin/mode overrides the flags %s", persisted, flags)


async def start_background(
    stack: contextlib.AsyncExitStack,
    settings: PolicySettings,
    store: SampleStore,
    dispatcher: Dispatcher,
    sessions: SessionTracker,
    replicas: ReplicaSync | None,
    canary: Canary | None = None,
) -> None:
    """Start the dispatcher, the idle sweeper, (with replicas) the replica sync and (safe updates) the canary
    test; ``stack`` stops them first."""
    tasks = [
        asyncio.create_task(dispatcher.run(), name="dispatcher"),
        asyncio.create_task(sessions.run_sweeper(), name="idle-sweeper"),
    ]
    if replicas is not None:
        await replicas.refresh()  # a mode or pause set at another replica holds from the first request
        tasks.append(asyncio.create_task(replicas.run(), name="replica-sync"))
        stack.push_async_callback(leave, replicas)  # runs after the background tasks stopped
    if canary is not None:
        tasks.append(asyncio.create_task(canary.run(), name="canary"))
    stack.push_async_callback(stop_background, settings, store, dispatcher, tasks, sessions)


async def log_resumed_work(
    settings: PolicySettings, store: SampleStore, version: str | None, scoring: PRMScoring | None
) -> None:
    counts = (await asyncio.to_thread(store.stats)).samples
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
