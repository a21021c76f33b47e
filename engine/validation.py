"""The one translation of pydantic validation errors into a client-facing message.

Every server (policy server, judge, dev engine) and the PRM config loader answer bad input with the same
wording: ``loc: msg`` per error, the ``loc`` dotted (``messages.0.content``) without FastAPI's ``body``
prefix, pydantic's ``Value error, `` prefix dropped, errors joined by ``; ``, at most ``limit`` of them.
Where one error is shown (it also names the offending ``param``), :func:`most_specific_error` picks the one
with the deepest location: a union field lists one error per branch, and the deepest names the value best.
Messages never echo the rejected input beyond what pydantic's ``msg`` says.

Bounded echo: an error may name a client value (a role, a lease id, a field name) to say what was wrong,
but only through :func:`clip` (a short prefix and the value's length), and every server passes its final
message through :func:`bounded_message`, so no error body grows with the client's input.

Yes/no words: :func:`bool_word` is the one reading of a true/false word, for command-line flags and request
headers alike (``1 true yes on`` / ``0 false no off``, any case, surrounding spaces ignored). An empty
value is neither: a header or flag that is present must say which.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ErrorDetails = Iterable[Mapping[str, Any]]
ECHO_MAX_CHARS = 64  # the longest prefix of a client value an error message quotes
MESSAGE_MAX_CHARS = 1024  # the longest error message (and param) any server answers
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def bool_word(text: str) -> bool | None:
    """True or False for a yes/no word (module docstring), None for anything else, the empty text included."""
    low = text.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    return None


def clip(value: Any, limit: int = ECHO_MAX_CHARS) -> str:
    """A client value as an error message quotes it: its ``repr`` when short, else a prefix and its length."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value) if isinstance(value, str) else text
    return f"{text[:limit]!r}... ({len(text)} characters)"


def clip_name(name: Any) -> str:
    """A field name or key as a message shows it: as is when short, else cut by :func:`clip`."""
    text = str(name)
    return text if len(text) <= ECHO_MAX_CHARS else clip(text)


def bounded_message(message: str, limit: int = MESSAGE_MAX_CHARS) -> str:
    """The message cut to ``limit`` characters (a last bound, whatever the message quoted)."""
    return message if len(message) <= limit else f"{message[:limit]}... (cut, {len(message)} characters)"


def error_location(error: Mapping[str, Any]) -> str:
    """``messages.0.content`` for ``loc=("body", "messages", 0, "content")``; "" at the root."""
    # A part may be a client's dict key (an unknown field's name): quoted at most ECHO_MAX_CHARS long.
    return ".".join(clip_name(part) for part in error.get("loc", ()) if part != "body")


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
