"""Typed errors raised by the engine client.

Every service that talks to an SGLang engine (real, dev, or a router in front of either) sees
only these four failure kinds, and maps them to HTTP once, in its own error handler:

    EngineError
    ├── EngineUnavailable   transport failure / 5xx / 429 that outlived the retry deadline (-> 503)
    ├── EngineTimeout       the per-call deadline passed (-> 504)
    ├── EngineBadResponse   2xx whose body breaks the protocol (ids mismatch, missing keys) (-> 502)
    └── EngineRejected      the engine answered 4xx: our request was wrong; never retried (-> 400/422)
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every engine-client failure."""

    def __init__(self, message: str, *, url: str | None = None, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.url = url
        self.status_code = status_code

    def __str__(self) -> str:  # keeps the url in logs without repeating it in every raise
        where = f" [{self.url}]" if self.url else ""
        code = f" (HTTP {self.status_code})" if self.status_code is not None else ""
        return f"{self.message}{code}{where}"


class EngineUnavailable(EngineError):
    """No engine could serve the call before the retry deadline (connection refused, 5xx, 429)."""


class EngineTimeout(EngineError):
    """The call did not finish within its deadline."""


class EngineBadResponse(EngineError):
    """The engine answered 2xx but the body is not what the protocol promises."""


class EngineRejected(EngineError):
    """The engine refused the request with a 4xx; retrying the same request cannot help."""
