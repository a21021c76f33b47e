"""The one translation of pydantic validation errors into a client-facing message.

Every server (policy server, judge, dev engine) and the PRM config loader answer bad input with the same
wording: ``loc: msg`` per error, the ``loc`` dotted (``messages.0.content``) without FastAPI's ``body``
prefix, pydantic's ``Value error, `` prefix dropped, errors joined by ``; ``, at most ``limit`` of them.
Where one error is shown (it also names the offending ``param``), :func:`most_specific_error` picks the one
with the deepest location: a union field lists one error per branch, and the deepest names the value best.
Messages never echo the rejected input beyond what pydantic's ``msg`` says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ErrorDetails = Iterable[Mapping[str, Any]]


def error_location(error: Mapping[str, Any]) -> str:
    """``messages.0.content`` for ``loc=("body", "messages", 0, "content")``; "" at the root."""
    return ".".join(str(part) for part in error.get("loc", ()) if part != "body")


def error_text(error: Mapping[str, Any]) -> str:
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


def describe_error(error: Mapping[str, Any]) -> str:
    loc = error_location(error)
    return f"{loc}: {error_text(error)}" if loc else error_text(error)


def describe_validation_errors(errors: ErrorDetails, *, limit: int | None = 5) -> str:
    """``loc: msg; loc: msg`` for the first ``limit`` errors (all of them when ``limit`` is None)."""
    shown: Sequence[Mapping[str, Any]] = list(errors)
    if limit is not None:
        shown = shown[:limit]
    return "; ".join(describe_error(e) for e in shown) or "invalid request"


def most_specific_error(errors: ErrorDetails) -> tuple[str, str | None]:
    """(message, param) of the error with the deepest location; param is its dotted location or None."""
    listed = list(errors)
    if not listed:
        return "invalid request", None
    deepest = max(listed, key=lambda e: len(tuple(e.get("loc", ()))))
    return describe_error(deepest), error_location(deepest) or None
