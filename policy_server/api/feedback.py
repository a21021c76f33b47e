"""Explicit feedback routes (thin): ``POST /v1/feedback`` (client key) and ``GET /admin/feedback`` (admin key).

``POST /v1/feedback`` body (docs/REWARD_MODES.md "Explicit feedback"):

- the target: ``response_id`` (the id the client got: ``chatcmpl-...``, ``resp_...``, ``msg_...``) OR
  ``session_id`` + ``turn_index`` (one of the two forms, not both);
- ``value``: ``"up"`` / ``"down"`` or a number in [-1, 1]; ``text`` (optional, at most 8000 characters): a
  typed correction, used as the OPD hint when ``--feedback-hint`` is on;
- ``idempotency_key`` (optional, 1-256 characters; also the ``Idempotency-Key`` header): the same key again
  counts once and gets the first answer back (``duplicate: true``).

Answer 200 ``{"feedback_id", "session_id", "turn_index", "state", "sample_status", "duplicate",
"policy"}``, ``state`` one of ``pending`` (the turn is not judged yet: applied with its verdict),
``applied``, ``late`` (the sample was already leased: counted in ``hindsight_policy_feedback_total`` and the
stats, never applied) or ``recorded`` (the turn cannot train: kept for audit). Unknown target: 404; a
malformed body or value: 400; an idempotency key already used on another turn: 409.

``GET /admin/feedback?session_id=S&limit=N`` -> ``{"feedback": [row, ...], "stats": {state: n, "total"}}``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.observability import valid_session_id
from engine.validation import clip, describe_validation_errors
from policy_server.api import response_models as rm
from policy_server.api.auth import require_admin, require_client
from policy_server.api.bodies import read_json_object
from policy_server.api.response_models import ok
from policy_server.api.route_docs import error_responses, json_request_body
from policy_server.errors import Conflict, InvalidRequest, NotFound
from policy_server.rewards.feedback import InvalidFeedback, feedback_value
from policy_server.state import PolicyState
from policy_server.store import FeedbackConflict

router = APIRouter(responses=error_responses(401, 413, 429, 503))
MAX_TEXT_CHARS = 8000


class FeedbackBody(BaseModel):
    """The ``POST /v1/feedback`` body (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    response_id: str | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = None
    turn_index: int | None = Field(None, ge=0, strict=True)
    value: Any = Field(..., description="'up', 'down' or a number in [-1, 1]")
    text: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)


def _state(request: Request) -> PolicyState:
    return request.app.state.policy


@router.post(
    "/v1/feedback",
    response_model=rm.FeedbackResult,
    responses={**ok(rm.FeedbackResult), **error_responses(400, 404, 409, 415)},
    openapi_extra=json_request_body(FeedbackBody.model_json_schema()),
)
async def post_feedback(request: Request) -> rm.FeedbackResult:
    st = _state(request)
    require_client(request, st.settings)
    raw = await read_json_object(request, st.settings.max_json_depth)
    try:
        body = FeedbackBody.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_errors(exc.errors())) from None
    try:
        value = feedback_value(body.value)
    except InvalidFeedback as exc:
        raise InvalidRequest(str(exc), param="value") from None
    key = body.idempotency_key or request.headers.get("idempotency-key") or None
    if key is not None and not 1 <= len(key) <= 256:
        raise InvalidRequest("idempotency key must be 1-256 characters", param="idempotency_key")
    target = await _target(st, body)
    text = body.text.strip() if body.text and body.text.strip() else None
    if text is not None and st.secrets is not None:  # a secret in feedback never reaches the store or the judge
        text = (await asyncio.to_thread(st.secrets.redact_text, text))[0]
    try:
        out = await asyncio.to_thread(
            st.store.add_feedback,
            *target,
            value=value,
            text=text,
            idempotency_key=key,
            policy=st.settings.feedback_policy,
            at_least_one=st.settings.at_least_one,
        )
    except FeedbackConflict as exc:
        raise Conflict(str(exc), param="idempotency_key") from None
    if out is None:
        raise NotFound(f"no recorded turn {target[1]} in session {clip(target[0])}")
    if not out.duplicate:
        st.metrics.feedback.labels(state=out.state).inc()
    return rm.FeedbackResult(**dict(out), policy=st.settings.feedback_policy)


async def _target(st: PolicyState, body: FeedbackBody) -> tuple[str, int]:
    """(session id, turn index) the body names; 400 for neither or both forms, 404 for an unknown response id."""
    by_turn = body.session_id is not None or body.turn_index is not None
    if (body.response_id is None) == (not by_turn):
        raise InvalidRequest("name the target by response_id or by session_id + turn_index (exactly one form)")
    if body.response_id is not None:
        found = await asyncio.to_thread(st.store.turn_by_response_id, body.response_id)
        if found is None:
            raise NotFound(f"no recorded turn answered with response id {clip(body.response_id)}", param="response_id")
        return found
    if body.session_id is None or body.turn_index is None:
        raise InvalidRequest("session_id and turn_index go together")
    sid = valid_session_id(body.session_id)
    if sid is None:
        raise InvalidRequest("session_id must be 1-256 printable characters", param="session_id")
    return sid, body.turn_index


@router.get(
    "/admin/feedback", response_model=rm.FeedbackList, responses={**ok(rm.FeedbackList), **error_responses(400)}
)
async def list_feedback(
    request: Request,
    session_id: str | None = None,
    limit: int = Query(100, ge=1, le=4096, description="rows at most, newest first"),
) -> rm.FeedbackList:
    st = _state(request)
    require_admin(request, st.settings)
    rows = await asyncio.to_thread(st.store.list_feedback, session_id, limit)
    return rm.FeedbackList(feedback=rows, stats=await asyncio.to_thread(st.store.feedback_stats))
