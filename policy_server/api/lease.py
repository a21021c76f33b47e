"""The lease protocol the trainer speaks (admin key): lease ready samples, ack them once trained on.

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
- ``POST /v1/samples/ack {"lease_id", "weight_version"?}``: consume; idempotent (a second ack answers
  ``already_acked``); ``revoked`` lists the lease's samples whose session was deleted meanwhile (never consumed:
  the trainer drops them; docs/USERS_DATA.md);
  404 for an unknown lease, 409 for an expired one (its samples went back to ready).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from engine.trajectories import merged_trajectories
from policy_server.api import response_models as rm
from policy_server.api.auth import admin_state
from policy_server.api.response_models import ok
from policy_server.api.route_docs import error_responses
from policy_server.errors import Conflict, InvalidRequest, NotFound
from policy_server.serving.versions import flag_rolled_back
from policy_server.store import LeaseError
from policy_server.store.ready_notifier import lease_when_ready
from policy_server.store.records import AckResult

# Every lease route may answer these (auth, body limit, admission, busy store); route-specific ones below.
router = APIRouter(responses=error_responses(401, 413, 429, 503))


class AckBody(BaseModel):
    lease_id: str = Field(..., min_length=1)
    # The weights the trainer consumed the samples into (the audit's trained_weight_version); optional.
    weight_version: str | None = Field(None, min_length=1, max_length=256)


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
    response_model=rm.Lease,
    response_model_exclude_unset=True,  # a Sample travels as its JSON (absent keys stay absent), as does the lease
    responses={200: {**ok(rm.Lease)[200], "links": _LEASE_TO_ACK}, **error_responses(400, 401)},
)
async def lease(
    request: Request,
    max_n: int = Query(64, alias="max", ge=1, description="samples at most, <= max_lease_size"),
    min_n: int = Query(1, alias="min", ge=1, description="return as soon as this many are ready, <= max"),
    wait_s: float = Query(0.0, ge=0, description="seconds to wait for min samples, <= max_lease_wait_s"),
    merge: bool = Query(False, description="also return the samples' merged session trajectories"),
) -> rm.Lease:
    st = admin_state(request)
    check_count(max_n, st.settings.max_lease_size, "max")
    if not 1 <= min_n <= max_n:
        raise InvalidRequest("min must be in [1, max]", param="min")
    if not (math.isfinite(wait_s) and 0 <= wait_s <= st.settings.max_lease_wait_s):
        raise InvalidRequest(f"wait_s must be in [0, {st.settings.max_lease_wait_s}]", param="wait_s")
    got = await lease_when_ready(
        st.store, st.ready, max_n=max_n, min_n=min_n, wait_s=wait_s, lease_s=st.settings.lease_timeout_s
    )
    lease_id, samples = got if got is not None else (None, [])
    if samples:  # made by a version since rolled back: flagged (the trainer sets it aside, docs/SAFE_UPDATES.md)
        samples = flag_rolled_back(samples, await asyncio.to_thread(st.store.rolled_back_versions))
    # Only a lease that hands out samples drains the PRM window (those samples' metrics).
    prm_metrics = st.scoring.drain_window() if st.scoring is not None and samples else {}
    body = rm.Lease(
        lease_id=lease_id, samples=samples, lease_timeout_s=st.settings.lease_timeout_s, prm_metrics=prm_metrics
    )
    if merge:
        # Set only with merge, so the answer without it has no ``trajectories`` key. Compares whole sequences:
        # off the loop.
        body.trajectories = await asyncio.to_thread(merged_trajectories, samples)
    return body


@router.post(
    "/v1/samples/ack",
    response_model=AckResult,
    response_model_exclude_unset=True,  # ``revoked`` only when a session deletion revoked some of the lease's samples
    responses={**ok(AckResult), **error_responses(400, 401, 404, 409, 415)},
)
async def ack(request: Request, body: AckBody) -> AckResult:
    st = admin_state(request)
    try:
        return await asyncio.to_thread(st.store.ack, body.lease_id, weight_version=body.weight_version)
    except LeaseError as exc:
        raise (NotFound if exc.kind == "unknown" else Conflict)(str(exc)) from None
