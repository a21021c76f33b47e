"""Bearer-key checks: a client key for the OpenAI routes, a separate admin key for trainer/admin routes.

Without ``api_key`` the client routes are open (loopback dev use). Admin routes require
``admin_api_key``; the client key opens them only with the explicit ``allow_client_key_for_admin``
opt-out (settings refuse an ``api_key`` without an ``admin_api_key`` otherwise), and they are open only
when no key is set at all. The check itself is engine.auth's (constant-time comparison).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from engine.auth import bearer_problem
from policy_server.errors import Unauthorized
from policy_server.settings import PolicySettings


def _check(request: Request, key: str | None, what: str) -> None:
    problem = bearer_problem(request.headers.get("authorization"), key)
    if problem == "missing":
        raise Unauthorized(f"missing bearer token ({what} key required)")
    if problem == "invalid":
        raise Unauthorized(f"invalid {what} key")


def require_client(request: Request, settings: PolicySettings) -> None:
    _check(request, settings.api_key, "api")


def require_client_any_header(request: Request, settings: PolicySettings) -> None:
    """The client key from ``Authorization: Bearer`` or, as Anthropic's clients send it, ``x-api-key``."""
    x_api_key = request.headers.get("x-api-key")
    if request.headers.get("authorization") is None and x_api_key is not None:
        problem = bearer_problem(f"Bearer {x_api_key}", settings.api_key)
        if problem is not None:
            raise Unauthorized("invalid api key (x-api-key)")
        return
    require_client(request, settings)


def require_admin(request: Request, settings: PolicySettings) -> None:
    key = settings.admin_api_key or (settings.api_key if settings.allow_client_key_for_admin else None)
    _check(request, key, "admin")


def admin_state(request: Request) -> Any:
    """The app's policy state, once the request passed the admin-key check (every admin and lease route)."""
    st = request.app.state.policy
    require_admin(request, st.settings)
    return st


def is_admin(request: Request, settings: PolicySettings) -> bool:
    """Whether the request carries the admin key (or admin routes are open): for detail shown only to admins."""
    try:
        require_admin(request, settings)
    except Unauthorized:
        return False
    return True
