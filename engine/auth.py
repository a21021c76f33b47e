"""The one bearer-key check of every Hindsight server (policy server, judge, dev engine).

- :func:`bearer_token` reads ``Authorization: Bearer <token>`` (scheme case-insensitive, surrounding
  whitespace ignored); anything else is no token.
- :func:`key_matches` compares a presented secret with the configured key in constant time, so the time
  to refuse a key says nothing about how much of it was right.
- :func:`bearer_problem` is the whole check: ``None`` when the request may pass (no key configured, or the
  bearer token matches), else ``"missing"`` (no bearer token) or ``"invalid"`` (a wrong one). Servers turn
  that into their own 401 body and headers in their one error mapping.
"""

from __future__ import annotations

import hmac
from typing import Literal

AuthProblem = Literal["missing", "invalid"]


def bearer_token(authorization: str | None) -> str | None:
    """The token of a ``Bearer`` Authorization header value, else None (absent, other scheme, empty token)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_matches(presented: str | None, key: str) -> bool:
    """Whether ``presented`` is exactly ``key``; constant time in the presented value's content."""
    return presented is not None and hmac.compare_digest(presented.encode(), key.encode())


def bearer_problem(authorization: str | None, key: str | None) -> AuthProblem | None:
    """Why a request with this Authorization header may not pass when ``key`` is required (None: it may)."""
    if not key:
        return None
    token = bearer_token(authorization)
    if token is None:
        return "missing"
    return None if key_matches(token, key) else "invalid"
