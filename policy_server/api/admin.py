"""Admin routes for the trainer and operators (admin key): sample lease/ack/stats, mode, weight sync.

- ``GET /v1/samples/lease?max=N&min=M&wait_s=S`` -> ``{"lease_id", "samples": [...]}``: up to N ready
  samples, as soon as at least M (default 1) are ready, else at S seconds whatever is ready (``lease_id``
  null and ``samples`` empty when nothing is); always 200 for valid parameters. The wait sleeps on the
  ready notifier (policy_server.store.ready_notifier), several leasers may wait at once and never share a sample.
  N outside [1, ``max_lease_size``], M outside [1, N] or S outside [0, ``max_lease_wait_s``] is a 400
  (explicit limits, no silent cap).
  ``prm_metrics``: the PRM metrics window drained by this lease (policy_server.rewards.scoring); only a lease that
  hands out samples drains it, an empty answer carries ``{}``; always ``{}`` without PRM scoring.
  ``merge=true`` adds ``trajectories``: the leased samples' token-continuous session turns merged into
  ``engine.records.MergedTrajectory`` entries (engine/trajectories.py; rows of two or more samples only), so
  a trainer can run each session's shared prompt once. The samples themselves are unchanged.
- ``POST /v1/samples/ack {"lease_id"}``: consume; idempotent (a second ack answers ``already_acked``);
  404 for an unknown lease, 409 for an expired one (its samples went back to ready).
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
- ``POST /admin/weights/update {"model_path", "weight_version"}`` -> ``{"success", "weight_version", "paused_s"}``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from engine.trajectories import merged_trajectories
from policy_server.api import response_models as rm
from policy_server.api.auth import require_admin
from policy_server.api.openai_schemas import error_responses
from policy_server.api.response_models import ok
from policy_server.errors import Conflict, InvalidRequest, NotFound
from policy_server.store import SAMPLE_STATUSES, LeaseError
from policy_server.store.ready_notifier import lease_when_ready

# Every admin route may answer these (auth, body limit, admission, busy store); route-specific ones below.
router = APIRouter(responses=error_responses(401, 413, 429, 503))


class AckBody(BaseModel):
    lease_id: str = Field(..., min_length=1)


class ModeBody(BaseModel):
    mode: str | None = None
    w_rl: float | None = None
    w_opd: float | None = None


class WeightsBody(BaseModel):
    # PATH_MAX, and no NUL: a path the OS cannot even look up is the caller's error (400), never the engine's
    model_path: str = Field(..., min_length=1, max_length=4096, pattern=r"^[^\x00]+$")
    weight_version: str = Field(..., min_length=1, max_length=256)


def check_count(value: int, most: int, param: str) -> None:
    """A row or sample count outside [1, ``most``] is a 400 naming ``param`` (the server's bound, not the schema's)."""
    if not 1 <= value <= most:
        raise InvalidRequest(f"{param} must be in [1, {most}]", param=param)


def declare_limits(spec: dict[str, Any], max_lease_size: int, max_lease_wait_s: float) -> None:
    """Put this server's own limits (its settings) into its OpenAPI ``spec``, in place: the lease and list
    parameters' maxima. (``min <= max`` relates two parameters, which OpenAPI cannot say: a 400.)"""
    maxima = {"max": max_lease_size, "min": max_lease_size, "limit": max_lease_size, "wait_s": max_lease_wait_s}
    for path in ("/v1/samples/lease", "/v1/samples"):
        for param in spec.get("paths", {}).get(path, {}).get("get", {}).get("parameters", []):
            if param.get("name") in maxima:
                param["schema"]["maximum"] = maxima[param["name"]]


def _st(request: Request) -> Any:
    st = request.app.state.policy
    require_admin(request, st.settings)
    return st


# The lease answer's lease_id is what ack takes: an OpenAPI link, so a stateful client (or fuzzer) acks a real lease.
_LEASE_TO_ACK = {
    "ack": {
        "operationRef": "#/paths/~1v1~1samples~1ack/post",
        "requestBody": {"lease_id": "$response.body#/lease_id"},
        "description": "ack the leased samples once trained on",
    }
}


@router.get(
    "/v1/samples/lease",
    response_model=None,
    responses={200: {**ok(rm.Lease)[200], "links": _LEASE_TO_ACK}, **error_responses(400, 401)},
)
async def lease(
    request: Request,
    max_n: int = Query(64, alias="max", ge=1, description="samples at most, <= max_lease_size"),
    min_n: int = Query(1, alias="min", ge=1, description="return as soon as this many are ready, <= max"),
    wait_s: float = Query(0.0, ge=0, description="seconds to wait for min samples, <= max_lease_wait_s"),
    merge: bool = Query(False, description="also return the samples' merged session trajectories"),
) -> dict[str, Any]:
    st = _st(request)
    check_count(max_n, st.settings.max_lease_size, "max")
    if not 1 <= min_n <= max_n:
        raise InvalidRequest("min must be in [1, max]", param="min")
    if not (math.isfinite(wait_s) and 0 <= wait_s <= st.settings.max_lease_wait_s):
        raise InvalidRequest(f"wait_s must be in [0, {st.settings.max_lease_wait_s}]", param="wait_s")
    got = await lease_when_ready(
        st.store, st.ready, max_n=max_n, min_n=min_n, wait_s=wait_s, lease_s=st.settings.lease_timeout_s
    )
    lease_id, samples = got if got is not None else (None, [])
    # Only a lease that hands out samples drains the PRM window (those samples' metrics).
    prm_metrics = st.scoring.drain_window() if st.scoring is not None and samples else {}
    body = {
        "lease_id": lease_id,
        "samples": [s.to_json() for s in samples],
        "lease_timeout_s": st.settings.lease_timeout_s,
        "prm_metrics": prm_metrics,
    }
    if merge:
        merged = await asyncio.to_thread(merged_trajectories, samples)  # compares whole sequences: off the loop
        body["trajectories"] = [t.to_json() for t in merged]
    return body


@router.post(
    "/v1/samples/ack", response_model=None, responses={**ok(rm.AckResult), **error_responses(400, 401, 404, 409, 415)}
)
async def ack(request: Request, body: AckBody) -> dict[str, Any]:
    st = _st(request)
    try:
        return await asyncio.to_thread(st.store.ack, body.lease_id)
    except LeaseError as exc:
        raise (NotFound if exc.kind == "unknown" else Conflict)(str(exc)) from None


@router.get("/v1/samples", response_model=None, responses={**ok(rm.SampleList), **error_responses(400, 401)})
async def list_samples(
    request: Request,
    session_id: str | None = None,
    status: str | None = None,
    limit: int = Query(100, ge=1, description="rows at most, <= max_lease_size"),
) -> dict[str, Any]:
    st = _st(request)
    check_count(limit, st.settings.max_lease_size, "limit")
    if status is not None and status not in SAMPLE_STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(SAMPLE_STATUSES)}", param="status")
    rows = await asyncio.to_thread(st.store.list_samples, session_id=session_id, status=status, limit=limit)
    return {"samples": rows}


@router.get("/v1/side_turns", response_model=None, responses={**ok(rm.SideTurnList), **error_responses(400, 401)})
async def list_side_turns(
    request: Request,
    session_id: str | None = None,
    limit: int = Query(100, ge=1, description="rows at most, <= max_lease_size"),
) -> dict[str, Any]:
    st = _st(request)
    check_count(limit, st.settings.max_lease_size, "limit")
    rows = await asyncio.to_thread(st.store.list_side_turns, session_id=session_id, limit=limit)
    return {"side_turns": rows}


@router.get("/v1/samples/stats", response_model=None, responses={**ok(rm.SampleStats), **error_responses(401)})
async def stats(request: Request) -> dict[str, Any]:
    st = _st(request)
    out = await asyncio.to_thread(st.store.stats)
    out.update(
        mode=st.mode_state.to_dict(),
        judge_configured=st.pipeline is not None,
        dispatch={
            "processed": st.dispatcher.processed,
            "retries": st.dispatcher.retries,
            "running_sessions": st.dispatcher.running_sessions,
        },
        weight_version=st.gate.version,
        weight_updates=st.weight_sync.updates,
        max_unconsumed_samples=st.settings.max_unconsumed_samples,
        prm=st.scoring.summary() if st.scoring is not None else {"enabled": False},
        feedback={**await asyncio.to_thread(st.store.feedback_stats), "policy": st.settings.feedback_policy},
    )
    return out


@router.get("/admin/mode", response_model=None, responses={**ok(rm.ModeResult), **error_responses(401)})
async def get_mode(request: Request) -> dict[str, Any]:
    return _st(request).mode_state.to_dict()


@router.post("/admin/mode", response_model=None, responses={**ok(rm.ModeResult), **error_responses(400, 401, 415)})
async def set_mode(request: Request, body: ModeBody) -> dict[str, Any]:
    st = _st(request)
    from policy_server.rewards.modes import InvalidMode, ModeState

    try:  # validated on a copy, persisted, then applied: a mode in force is always the persisted one
        snap = ModeState(**st.mode_state.to_dict()).set(body.mode, body.w_rl, body.w_opd)
    except InvalidMode as exc:
        raise InvalidRequest(str(exc)) from None
    await asyncio.to_thread(st.store.set_runtime, "mode", asdict(snap))
    await asyncio.to_thread(st.store.notify_admin)  # the other replicas follow at once
    st.mode_state.set(snap.mode, snap.w_rl, snap.w_opd)
    return st.mode_state.to_dict()


@router.post(
    "/admin/weights/update",
    response_model=None,
    responses={**ok(rm.WeightsUpdated), **error_responses(400, 401, 415, 502, 503)},
)
async def update_weights(request: Request, body: WeightsBody) -> dict[str, Any]:
    st = _st(request)
    try:
        result = await st.weight_sync.update(body.model_path, body.weight_version)
    except Exception:
        st.metrics.weight_updates.labels(outcome="failed").inc()
        raise
    st.metrics.weight_updates.labels(outcome="ok").inc()
    st.metrics.paused_s.set(result["paused_s"])
    return result
