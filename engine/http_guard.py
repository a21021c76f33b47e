"""Hostile-input guards shared by every Hindsight HTTP server (judge, policy server, dev engine).

Role: the pieces that must run BEFORE a route sees a request, in one place, each sized by its server's
settings:

- :class:`BodyLimitMiddleware` (pure ASGI): a body larger than ``max_body_bytes`` is answered 413 while it
  is being read: at once when ``Content-Length`` says so, else as soon as the streamed bytes pass the
  limit; never parsed, and before any route decides auth (an unauthenticated 200 MB body costs nothing).
  An accepted body is buffered (it is at most ``max_body_bytes``) and replayed to the app unchanged.
  With ``json_max_depth`` (servers whose framework parses the body itself) a JSON body is also checked
  with :func:`parse_json_body` first and refused 400 when it fails. With ``require_json`` a non-empty
  body whose ``Content-Type`` names anything but JSON (``application/json``, ``*/*+json``) is refused 415
  unread (no Content-Type at all is read as JSON). With ``max_body_chars`` the limit counts characters
  of the UTF-8 text (bytes are bounded at 4 per character while reading, then the characters are counted).
- :class:`AdmissionMiddleware` (pure ASGI): at most ``max_in_flight`` requests run at once (streams count
  until their last byte); beyond that the answer is 429 with ``Retry-After``. Health, readiness and
  metrics probes are exempt, so an overloaded server still says so.
- :class:`UnexpectedErrorMiddleware` (pure ASGI): the servers' top-level handler for bugs: one 500 in
  the server's error shape, one log record with the request id, tracebacks rate-limited.
- :func:`parse_json_body`: ``json.loads`` whose deep nesting is a clear error (``"[" * 100000`` raises
  RecursionError inside the decoder), then :func:`check_json_value`: nesting at most ``max_depth`` levels
  (chat templates and validators recurse: 600 levels crash them) and no unpaired UTF-16 surrogate in any
  string or key (``"\\ud800"`` is valid JSON but no valid text: tokenizers, UTF-8 encoders and SQLite
  all fail on it). Both raise :class:`BadJSON` whose message never echoes the client's content.

Error bodies differ per server (OpenAI's shape, the judge's, SGLang's), so each middleware takes an
``error_body(status, message) -> dict`` callable from its server.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.validation import clip

ErrorBody = Callable[[int, str], dict[str, Any]]
PROBE_PATHS = ("/health", "/ready", "/metrics")


class BadJSON(ValueError):
    """A body that is not acceptable JSON; the message names the problem, never the content."""


async def _send_error(send: Any, status: int, body: dict[str, Any], extra: list[tuple[bytes, bytes]]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """413 for a body over ``max_body_bytes``, decided while reading (see the module docstring)."""

    def __init__(
        self,
        app: Any,
        *,
        max_body_bytes: int,
        error_body: ErrorBody,
        json_max_depth: int | None = None,
        require_json: bool = False,
        max_body_chars: int | None = None,
    ):
        self.app = app
        self.max_body_chars = max_body_chars
        # A character is at most 4 UTF-8 bytes: the byte bound while reading, before the characters are counted.
        self.max_body_bytes = 4 * max_body_chars if max_body_chars is not None else max_body_bytes
        self.require_json = require_json
        self.error_body = error_body
        # Set for servers whose framework parses JSON bodies itself (FastAPI body models): the body is
        # checked here first (parse_json_body), so a hostile one is a 400 before any route code runs.
        self.json_max_depth = json_max_depth

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send)
            return
        ctype = headers.get(b"content-type")
        has_body = (declared is not None and declared.strip() not in (b"", b"0")) or b"transfer-encoding" in headers
        if self.require_json and has_body and ctype is not None and not _is_json_type(ctype):
            shown = clip(ctype.decode("latin-1").split(";")[0].strip())
            msg = f"Content-Type must be application/json, got {shown}"
            await _send_error(send, 415, self.error_body(415, msg), [(b"connection", b"close")])
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chars = self.max_body_chars
        if chars is not None and len(body) > chars and len(body.decode("utf-8", "replace")) > chars:
            await self._too_large(send)
            return
        if self.json_max_depth is not None and body.strip() and _is_json(scope):
            try:
                parse_json_body(body, max_depth=self.json_max_depth)
            except BadJSON as exc:
                await _send_error(send, 400, self.error_body(400, str(exc)), [])
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect watchers wait on the real channel

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        if self.max_body_chars is not None:
            msg = f"request body exceeds the limit of {self.max_body_chars} characters"
        else:
            msg = f"request body exceeds the limit of {self.max_body_bytes} bytes"
        # connection: close: the rest of the body is never read, so the connection cannot be reused.
        await _send_error(send, 413, self.error_body(413, msg), [(b"connection", b"close")])


def _is_json_type(ctype: bytes) -> bool:
    media = ctype.split(b";")[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


def _is_json(scope: dict[str, Any]) -> bool:
    ctype = dict(scope.get("headers") or []).get(b"content-type", b"application/json")
    return b"json" in ctype.lower()


class AdmissionMiddleware:
    """At most ``max_in_flight`` requests at once; 429 + Retry-After beyond it (probes exempt)."""

    def __init__(
        self,
        app: Any,
        *,
        max_in_flight: int,
        error_body: ErrorBody,
        retry_after_s: int = 1,
        exempt_paths: tuple[str, ...] = PROBE_PATHS,
    ):
        self.app = app
        self.max_in_flight = max_in_flight
        self.error_body = error_body
        self.retry_after_s = retry_after_s
        self.exempt_paths = exempt_paths
        self.in_flight = 0
        self.refused = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith(self.exempt_paths):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            self.refused += 1
            msg = f"server busy: {self.max_in_flight} requests in flight; retry after {self.retry_after_s}s"
            await _send_error(
                send, 429, self.error_body(429, msg), [(b"retry-after", str(self.retry_after_s).encode())]
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class UnexpectedErrorMiddleware:
    """Pure ASGI, inside the request-id middleware: a bug in a route becomes ONE 500 in the server's error
    shape (the exception's type only: its text may quote the client's input) and ONE log record with the
    request id; the traceback is logged for at most ``tracebacks_per_min`` errors a minute, the rest get a
    single line. Not re-raised: re-raising makes Starlette and uvicorn log the same traceback twice more,
    outside the request's context."""

    def __init__(self, app: Any, *, error_body: ErrorBody, logger: logging.Logger, tracebacks_per_min: int = 10):
        self.app = app
        self.error_body = error_body
        self.logger = logger
        self.tracebacks_per_min = tracebacks_per_min
        self._window: list[float] = []  # monotonic times of the tracebacks logged in the last minute

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 (the top-level handler of the server: logged, answered 500)
            self._log(scope, exc)
            if not started:
                await _send_error(send, 500, self.error_body(500, f"internal error ({type(exc).__name__})"), [])

    def _log(self, scope: dict[str, Any], exc: Exception) -> None:
        now = time.monotonic()
        self._window = [t for t in self._window if now - t < 60.0]
        where = f"{scope.get('method', '')} {scope.get('path', '')}"
        if len(self._window) < self.tracebacks_per_min:
            self._window.append(now)
            self.logger.error("unhandled error in %s", where, exc_info=exc)
        else:
            self.logger.error(
                "unhandled error in %s: %s (traceback suppressed: over %d a minute)",
                where,
                type(exc).__name__,
                self.tracebacks_per_min,
            )


def check_json_value(value: Any, max_depth: int) -> None:
    """Raise BadJSON when ``value`` nests deeper than ``max_depth`` or holds an unpaired surrogate.

    Iterative (an explicit stack), so a hostile value cannot make this check itself recurse.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise BadJSON(f"JSON nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                _check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in node)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadJSON("a string holds an unpaired UTF-16 surrogate (not valid Unicode text)") from None


def parse_json_body(raw: bytes, *, max_depth: int) -> Any:
    """Decode a request body (see the module docstring); BadJSON for anything a server must refuse."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadJSON(f"JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadJSON(
            f"body is not valid JSON ({type(exc).__name__} at position "
            f"{getattr(exc, 'pos', getattr(exc, 'start', '?'))})"
        ) from None
    check_json_value(value, max_depth)
    return value
