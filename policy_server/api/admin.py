"""Admin routes for operators and the trainer (admin key): sample and side-turn reads, stats, mode, weight sync.

The lease protocol (lease, ack) is policy_server.api.lease.

- ``GET /v1/samples?session_id=S&status=X&limit=N`` -> ``{"samples": [row, ...]}``: a NON-consuming read
  (no lease, no state change; operators, the demo) of sample rows oldest first: ``sample_id, session_id,
  turn_index, status, reject_reason, attempts, last_error, created_at, updated_at``, ``sample`` (the
  Sample JSON once judged, else null) and ``turn`` (``pairing``, ``pairing_note``, ``next_state``: the
  messages typed by role that followed the reply). Both filters optional; N in [1, ``max_lease_size``] (default 100);
  an unknown status is a 400.
- ``GET /v1/side_turns?session_id=S&limit=N`` -> ``{"side_turns": [row, ...]}``: side turns (served, never
  trained), newest first: ``side_id, session_id, created_at, rule`` (which side rule matched,
  policy_server.serving.side_rules) and ``record`` (the token-exact TurnRecord JSON). Sample rows' ``turn``
  also names the rule that identified the session (``session_rule``, ``session_decision``).
- ``GET /v1/samples/stats``: counts by status, reject reasons, pending retries, sessions, leases, and ``prm``
  (cumulative PRM metrics and outcome counts, not draining; ``{"enabled": false}`` without scoring).
  ``feedback``: explicit feedback by state (``pending``, ``applied``, ``late``, ``recorded``, ``total``) and
  the ``policy`` in force (policy_server.api.feedback).
- ``GET|POST /admin/mode {"mode", "w_rl", "w_opd"}``: the reward mode used for turns judged from now on;
  persisted in the store, so it survives a restart (it then overrides the ``--mode``/``--w-*`` flags).

The weight routes (``/admin/weights``: the ledger, update, promote, rollback) are policy_server.api.weights.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from engine.records import ModeSnapshot
from policy_server.api import response_models as rm
from policy_server.api.auth import admin_state
from policy_server.api.lease import check_count
from policy_server.api.response_models import ok
from policy_server.api.route_docs import error_responses
from policy_server.errors import InvalidRequest
from policy_server.store import SAMPLE_STATUSES

# Every admin route may answer these (auth, body limit, admission, busy store); route-specific ones below.
router = APIRouter(responses=error_responses(401, 413, 429, 503))


class ModeBody(BaseModel):
    mode: str | None = None
    w_rl: float | None = None
    w_opd: float | None = None


@router.get("/v1/samples", response_model=rm.SampleList, responses={**ok(rm.SampleList), **error_responses(400, 401)})
async def list_samples(
    request: Request,
    session_id: str | None = None,
    status: str | None = None,
    limit: int = Query(100, ge=1, description="rows at most, <= max_lease_size"),
) -> rm.SampleList:
    st = admin_state(request)
    check_count(limit, st.settings.max_lease_size, "limit")
    if status is not None and status not in SAMPLE_STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(SAMPLE_STATUSES)}", param="status")
    rows = await asyncio.to_thread(st.store.list_samples, session_id=session_id, status=status, limit=limit)
    return rm.SampleList(samples=rows)


@router.get(
    "/v1/side_turns", response_model=rm.SideTurnList, responses={**ok(rm.SideTurnList), **error_responses(400, 401)}
)
async def list_side_turns(
    request: Request,
    session_id: str | None = None,
    limit: int = Query(100, ge=1, description="rows at most, <= max_lease_size"),
) -> rm.SideTurnList:
    st = admin_state(request)
    check_count(limit, st.settings.max_lease_size, "limit")
    rows = await asyncio.to_thread(st.store.list_side_turns, session_id=session_id, limit=limit)
    return rm.SideTurnList(side_turns=rows)


@router.get(
    "/v1/samples/stats", response_model=rm.SampleStats, responses={**ok(rm.SampleStats), **error_responses(401)}
)
async def stats(request: Request) -> rm.SampleStats:
    st = admin_state(request)
    counts = await asyncio.to_thread(st.store.stats)
    feedback = await asyncio.to_thread(st.store.feedback_stats)
    return rm.SampleStats(
        **dict(counts),
        mode=st.mode_state.snapshot(),
        judge_configured=st.pipeline is not None,
        dispatch=rm.Dispatch(
            processed=st.dispatcher.processed,
            retries=st.dispatcher.retries,
            running_sessions=st.dispatcher.running_sessions,
        ),
        weight_version=st.gate.version,
        weight_updates=st.weight_sync.updates,
        max_unconsumed_samples=st.settings.max_unconsumed_samples,
        prm=st.scoring.summary() if st.scoring is not None else {"enabled": False},
        feedback=rm.FeedbackStats(**dict(feedback), policy=st.settings.feedback_policy),
    )


@router.get("/admin/mode", response_model=ModeSnapshot, responses={**ok(ModeSnapshot), **error_responses(401)})
async def get_mode(request: Request) -> ModeSnapshot:
    return admin_state(request).mode_state.snapshot()


@router.post(
    "/admin/mode", response_model=ModeSnapshot, responses={**ok(ModeSnapshot), **error_responses(400, 401, 415)}
)
async def set_mode(request: Request, body: ModeBody) -> ModeSnapshot:
    st = admin_state(request)
    from policy_server.rewards.modes import InvalidMode, ModeState

    current = st.mode_state.snapshot()
    try:  # validated on a copy, persisted, then applied: a mode in force is always the persisted one
        snap = ModeState(current.mode, current.w_rl, current.w_opd).set(body.mode, body.w_rl, body.w_opd)
    except InvalidMode as exc:
        raise InvalidRequest(str(exc)) from None
    await asyncio.to_thread(st.store.set_runtime, "mode", snap)
    await asyncio.to_thread(st.store.notify_admin)  # the other replicas follow at once
    return st.mode_state.set(snap.mode, snap.w_rl, snap.w_opd)
