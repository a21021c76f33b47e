"""Users' data routes (thin): delete a session, read its audit trail (docs/USERS_DATA.md).

- ``DELETE /v1/sessions/{session_id}``: the admin key, or the session's own deletion token in
  ``X-Hindsight-Deletion-Token`` (every answer of the session carried it; policy_server.serving.deletion_tokens).
  Removes the session's data in one transaction (policy_server.store.privacy) and answers what was removed,
  which leased samples were revoked (their lease's ack lists them under ``revoked``) and which samples were
  already consumed into weights (with the weight version their ack named). 404 when the store holds nothing
  of the session; deleting again is a 404 (nothing left), never a 5xx.
- ``GET /v1/sessions/{session_id}/audit`` (admin key): each turn with its sample's status and reject reason,
  the judge's stored verdicts (votes, raw outputs, guard results, hint), the mode and weights, and the weight
  version it was sampled by and trained into. 404 for a session without turns.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from policy_server.api.auth import is_admin, require_admin
from policy_server.api.response_models import ok
from policy_server.api.route_docs import error_responses
from policy_server.errors import NotFound, Unauthorized
from policy_server.serving.deletion_tokens import TOKEN_HEADER
from policy_server.state import PolicyState
from policy_server.store.privacy import SessionAudit, SessionDeletion

router = APIRouter(responses=error_responses(401, 413, 429, 503))


def _state(request: Request) -> PolicyState:
    return request.app.state.policy


@router.delete(
    "/v1/sessions/{session_id}",
    response_model=SessionDeletion,
    responses={**ok(SessionDeletion), **error_responses(401, 404)},
)
async def delete_session(request: Request, session_id: str) -> SessionDeletion:
    st = _state(request)
    token = request.headers.get(TOKEN_HEADER)
    if token is not None and st.deletion_tokens is not None:
        if not st.deletion_tokens.check(session_id, token):
            raise Unauthorized(f"invalid {TOKEN_HEADER} for this session")
    elif not is_admin(request, st.settings):
        require_admin(request, st.settings)  # raises with the admin key's own message
    out = await asyncio.to_thread(st.store.delete_session, session_id)
    if out is None:
        raise NotFound("the store holds nothing of this session")
    for table, n in out.deleted.model_dump().items():
        st.metrics.deleted_rows.labels(table=table, cause="deletion").inc(n)
    return out


@router.get(
    "/v1/sessions/{session_id}/audit",
    response_model=SessionAudit,
    responses={**ok(SessionAudit), **error_responses(401, 404)},
)
async def session_audit(request: Request, session_id: str) -> SessionAudit:
    st = _state(request)
    require_admin(request, st.settings)
    audit = await asyncio.to_thread(st.store.session_audit, session_id)
    if audit is None:
        raise NotFound("no turn of this session is stored")
    return audit
