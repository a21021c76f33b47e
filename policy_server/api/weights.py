"""Weight routes (admin key): push new weights, read the version ledger, promote a canary, roll back.

- ``POST /admin/weights/update {"model_path", "weight_version", "parent_version"?, "sample_count"?,
  "sample_id_min"?, "sample_id_max"?}`` -> ``{"success", "weight_version", "paused_s", "state"}``: records the
  version in the ledger and loads it (policy_server.serving.versions). 409 when another version is being
  loaded or is canary (at any replica), when the version exists, when ``parent_version`` is not the live
  version, or when a rollback restored the live version and the push does not name it (after a rollback the
  trainer reloads the restored weights first); 400 when the engines refuse the checkpoint; 502 when they fail.
- ``GET /admin/weights?limit=N`` -> ``{"live", "canary", "comparison", "versions": [...]}``: the ledger, newest
  first, the live and canary versions' names (null when none) and, while a canary runs with --safe-updates, the
  canary test now (engine.sequential.Comparison: ``{"canary", "live"}`` each ``{"sessions", "mean",
  "interval": {"lo", "hi"}}``, ``"diff": {"lo", "hi"}`` (canary - live), ``"decision"``).
- ``POST /admin/weights/promote`` -> ``{"version": row}``: the canary becomes live; 409 without a canary.
- ``POST /admin/weights/rollback {"to": V}`` -> ``{"live": row, "rolled_back": [rows]}``: the engines load
  V's checkpoint and V becomes live, every newer live or canary version rolled_back. Without ``to``: the
  canary is dropped (409 without one). 404 for a V the ledger never recorded, 409 for one that is neither
  live nor retired.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.records import WeightsPushed, WeightVersion
from engine.sequential import Comparison
from policy_server.api.auth import admin_state
from policy_server.api.response_models import ok
from policy_server.api.route_docs import error_responses
from policy_server.serving.versions import Push, VersionControl

router = APIRouter(responses=error_responses(401, 413, 429, 503))

VERSION_CHARS = 256
SAMPLE_ID_CHARS = 256


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # PATH_MAX, and no NUL: a path the OS cannot even look up is the caller's error (400), never the engine's
    model_path: str = Field(..., min_length=1, max_length=4096, pattern=r"^[^\x00]+$")
    weight_version: str = Field(..., min_length=1, max_length=VERSION_CHARS)
    parent_version: str | None = Field(
        None, min_length=1, max_length=VERSION_CHARS, description="the version these weights were trained from"
    )
    sample_count: int | None = Field(None, ge=0, description="samples trained on since the parent")
    sample_id_min: str | None = Field(None, max_length=SAMPLE_ID_CHARS)
    sample_id_max: str | None = Field(None, max_length=SAMPLE_ID_CHARS)


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str | None = Field(None, min_length=1, max_length=VERSION_CHARS, description="default: drop the canary")


class WeightLedger(BaseModel):
    live: str | None
    canary: str | None
    comparison: Comparison | None = None  # the canary test's own record (engine.sequential)
    versions: list[WeightVersion]


class Promoted(BaseModel):
    version: WeightVersion


class RolledBack(BaseModel):
    live: WeightVersion
    rolled_back: list[WeightVersion]


def _versions(request: Request) -> VersionControl:
    st = admin_state(request)
    assert st.versions is not None  # built in the lifespan, before the first request
    versions: VersionControl = st.versions
    return versions


@router.post(
    "/admin/weights/update",
    response_model=WeightsPushed,
    responses={**ok(WeightsPushed), **error_responses(400, 401, 409, 415, 502, 503)},
)
async def update_weights(request: Request, body: WeightsBody) -> WeightsPushed:
    st = admin_state(request)
    push = Push(
        model_path=body.model_path,
        weight_version=body.weight_version,
        parent=body.parent_version,
        sample_count=body.sample_count,
        sample_id_min=body.sample_id_min,
        sample_id_max=body.sample_id_max,
    )
    try:
        done = await _versions(request).push(push)
    except Exception:
        st.metrics.weight_updates.labels(outcome="failed").inc()
        raise
    st.metrics.weight_updates.labels(outcome="ok").inc()
    st.metrics.paused_s.set(done.paused_s)
    return WeightsPushed(
        success=True, weight_version=done.version.version, paused_s=round(done.paused_s, 4), state=done.version.state
    )


@router.get("/admin/weights", response_model=WeightLedger, responses={**ok(WeightLedger), **error_responses(401)})
async def list_weights(
    request: Request, limit: int = Query(100, ge=1, le=10_000, description="versions at most, newest first")
) -> WeightLedger:
    st = admin_state(request)
    store = st.store
    rows = await asyncio.to_thread(store.list_versions, limit)
    live = await asyncio.to_thread(store.version_in_state, "live")
    canary = await asyncio.to_thread(store.version_in_state, "canary")
    cmp = await st.canary.comparison() if st.canary is not None and canary is not None else None
    return WeightLedger(
        live=live.version if live else None,
        canary=canary.version if canary else None,
        comparison=cmp,
        versions=rows,
    )


@router.post(
    "/admin/weights/promote", response_model=Promoted, responses={**ok(Promoted), **error_responses(401, 409, 502)}
)
async def promote(request: Request) -> Promoted:
    return Promoted(version=await _versions(request).promote())


@router.post(
    "/admin/weights/rollback",
    response_model=RolledBack,
    responses={**ok(RolledBack), **error_responses(400, 401, 404, 409, 415, 502)},
)
async def rollback(request: Request, body: RollbackBody) -> RolledBack:
    changed = await _versions(request).rollback(body.to)
    return RolledBack(live=changed[0], rolled_back=changed[1:])
