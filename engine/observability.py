"""Shared observability for Hindsight's HTTP services: request/session ids, logging, startup config, route metrics.

The one home of this code; services import it, never copy it. Adopting it in a service::

    # cli.py: the entrypoint configures logging ONCE, then lets uvicorn's loggers flow through it
    from engine.observability import configure_logging
    configure_logging(args.log_level, json_logs=args.log_json)
    uvicorn.run(app, host=..., port=..., log_level=args.log_level, log_config=None, access_log=False)

    # app.py, in create_app(settings)
    from engine.observability import RequestContextMiddleware, RouteMetrics, log_settings
    route_metrics = RouteMetrics(my_registry, prefix="hindsight_policy")   # the service's own registry
    app.add_middleware(RequestContextMiddleware, route_metrics=route_metrics)  # add it LAST: outermost
    # first thing in the lifespan:
    log_settings(logger, settings, title="policy server")
    # background work outside a request (e.g. judge dispatch of a session's turn):
    with bind_ids(session_id=sid): ...
    # forward the ids upstream: pass event_hooks={"request": [propagate_request_id]} to EngineClient /
    # JudgeClient, or to engine.http_client.build_async_http for a pool shared by several clients

Contract:

- ``RequestContextMiddleware`` is pure ASGI (streaming bodies pass through unbuffered). Each HTTP request gets
  a request id: the client's ``X-Request-ID`` when it is 1-128 visible ASCII characters (0x21-0x7E; no spaces,
  so ``request_id=...`` log fields stay splittable), else a fresh ``uuid4().hex``. The id is echoed in the
  response's ``X-Request-ID`` header and held in a contextvar for the whole request, as is the session id from
  ``X-Session-Id`` (read as UTF-8; :func:`valid_session_id`'s rule, else none: this module never rejects a
  request, the policy server answers an invalid one 400 with the same rule). One access line per request (``METHOD path -> status in ms``; the
  query string is never logged) except for the probe paths /health, /ready, /metrics. The access line and the
  route metrics are written just before the response's last body message is sent, so a client holding a whole
  response (and anyone it tells) already finds it counted and logged. A response that never
  started because the app raised counts as status 500, a cancelled one (client gone) as 499. Limitation:
  that 500 is written by Starlette's ServerErrorMiddleware, which sits outside every added middleware, so
  it carries no ``X-Request-ID`` header (the access line still logs the id).
- ``RouteMetrics`` (on a registry the service owns; the one request-latency histogram of each service): ``<prefix>_http_requests_total`` and
  ``<prefix>_http_request_duration_seconds`` labelled ``route`` (the matched route's path template, e.g.
  ``/v1/models/{model:path}``; ``<unmatched>`` for 404s: never the raw URL), ``method`` (standard methods,
  else ``OTHER``) and ``status``. Label cardinality is thus bounded by the app's route table.
- ``configure_logging(level, json_logs)`` installs one root handler whose filter stamps ``request_id`` and
  ``session_id`` (``-`` outside a request) on every record; plain text by default, JSON lines on request.
- ``log_settings`` logs the resolved settings as one line (``<title> resolved config: <JSON>``). A field
  whose name has a secret-like word (``key``, ``secret``, ``token``, ``password``... as a whole word of the
  snake_case or camelCase name, so ``api_key``/``hfToken`` are hidden but ``max_new_tokens`` and
  ``tokenizer_path`` are not) shows ``"***"`` when set (``null`` when unset: auth off is worth seeing), and
  credentials inside URLs (``http://user:pass@host``) are masked too.
- Every line the installed handler writes (plain or JSON) has secret query parameters in URLs masked
  (``?api_key=...``, ``&token=...``: the names ``redact_query_secrets`` knows), whoever logged them: reward
  clients that cannot send headers put the judge key in the URL, and e.g. httpx logs request URLs.
- ``propagate_request_id`` is an httpx request event hook that forwards the current ids to upstream calls
  (a session id only when it is ASCII).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import IO, Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, SecretBytes, SecretStr
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)
access_logger = logging.getLogger(__name__ + ".access")  # its own name, so operators can filter access lines

REQUEST_ID_HEADER = "X-Request-ID"
SESSION_ID_HEADER = "X-Session-Id"
MAX_REQUEST_ID_CHARS = 128
MAX_SESSION_ID_CHARS = 256
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
UNMATCHED_ROUTE = "<unmatched>"
STANDARD_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SECRET_WORDS = frozenset(
    {"key", "apikey", "secret", "token", "password", "passwd", "credential", "credentials", "authorization"}
)
REDACTED = "***"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("hindsight_request_id", default=None)
_session_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("hindsight_session_id", default=None)
_VISIBLE_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_QUERY_SECRET = re.compile(
    r"(?P<name>[?&](?:api_key|apikey|api-key|key|token|access_token|secret|password)=)"
    r"[^&#\s\"'\\]+",
    re.IGNORECASE,
)


# ---------------------------------------------------------------------------------------------- ids
def current_request_id() -> str | None:
    return _request_id.get()


def current_session_id() -> str | None:
    return _session_id.get()


def new_request_id() -> str:
    return uuid.uuid4().hex


def valid_request_id(value: str | None) -> str | None:
    """The client's id if acceptable (1-128 visible ASCII chars), else None."""
    return value if value is not None and _VISIBLE_ID.fullmatch(value) else None


def valid_session_id(value: str | None) -> str | None:
    """The one session-id rule: surrounding whitespace trimmed, then 1-256 printable characters (Unicode
    letters allowed, no control characters); None when the value breaks it."""
    value = value.strip() if value is not None else None
    if not value or len(value) > MAX_SESSION_ID_CHARS or not value.isprintable():
        return None
    return value


def header_text(raw: str | None) -> str | None:
    """A header value as UTF-8 text (ASGI servers hand headers over as latin-1); None if not UTF-8."""
    if raw is None:
        return None
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return None


@contextmanager
def bind_ids(*, request_id: str | None = None, session_id: str | None = None) -> Iterator[None]:
    """Set the ids for work outside a request (a background task); restored on exit."""
    tokens = (_request_id.set(request_id), _session_id.set(session_id))
    try:
        yield
    finally:
        _session_id.reset(tokens[1])
        _request_id.reset(tokens[0])


def request_id_headers() -> dict[str, str]:
    """Headers that forward the current ids to an upstream call (empty outside a request)."""
    headers = {}
    if (rid := _request_id.get()) is not None:
        headers[REQUEST_ID_HEADER] = rid
    # A non-ASCII session id (valid here) stays local: httpx writes header values as ASCII.
    if (sid := _session_id.get()) is not None and sid.isascii():
        headers[SESSION_ID_HEADER] = sid
    return headers


async def propagate_request_id(request: httpx.Request) -> None:
    """httpx ``event_hooks={"request": [propagate_request_id]}``: the caller's ids go upstream unless set."""
    for name, value in request_id_headers().items():
        request.headers.setdefault(name, value)


# ---------------------------------------------------------------------------------------------- metrics
class RouteMetrics:
    """Request count and latency per route template, method and status, on the service's own registry."""

    def __init__(
        self, registry: CollectorRegistry, prefix: str, buckets_s: tuple[float, ...] = LATENCY_BUCKETS_S
    ) -> None:
        labels = ["route", "method", "status"]
        self.requests = Counter(
            f"{prefix}_http_requests_total",
            "HTTP requests by route template, method, status",
            labels,
            registry=registry,
        )
        self.latency = Histogram(
            f"{prefix}_http_request_duration_seconds",
            "HTTP request latency (to the last body byte) by route template, method, status",
            labels,
            buckets=buckets_s,
            registry=registry,
        )

    def observe(self, route: str, method: str, status: int, duration_s: float) -> None:
        method = method if method in STANDARD_METHODS else "OTHER"
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.latency.labels(route=route, method=method, status=str(status)).observe(duration_s)


def route_template(scope: Scope) -> str:
    """The path template of the route that handled (or would handle) this request; never the raw path."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    # Not routed (a middleware answered first, e.g. a 401): match the app's route table ourselves.
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", ())
    partial: str | None = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(getattr(route, "path", UNMATCHED_ROUTE))
        if match is Match.PARTIAL and partial is None:
            partial = str(getattr(route, "path", UNMATCHED_ROUTE))
    return partial or UNMATCHED_ROUTE


# ---------------------------------------------------------------------------------------------- middleware
class RequestContextMiddleware:
    """Pure ASGI: request/session ids in contextvars, ``X-Request-ID`` echo, route metrics, one access line."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        route_metrics: RouteMetrics | None = None,
        access_log: bool = True,
        quiet_paths: frozenset[str] = QUIET_PATHS,
    ) -> None:
        self.app = app
        self.route_metrics = route_metrics
        self.access_log = access_log
        self.quiet_paths = quiet_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = valid_request_id(headers.get(REQUEST_ID_HEADER)) or new_request_id()
        sid = valid_session_id(header_text(headers.get(SESSION_ID_HEADER)))
        tokens = (_request_id.set(rid), _session_id.set(sid))
        status: int | None = None
        recorded = False
        started = time.perf_counter()
        body_left: int | None = None  # bytes still to send of a response with a Content-Length

        async def send_with_id(message: Message) -> None:
            nonlocal status, recorded, body_left
            if message["type"] == "http.response.start":
                status = int(message["status"])
                response_headers = MutableHeaders(scope=message)
                response_headers[REQUEST_ID_HEADER] = rid
                length = response_headers.get("content-length", "")
                body_left = int(length) if length.isdigit() else None
            elif message["type"] == "http.response.body" and not recorded:
                if body_left is not None:
                    body_left -= len(message.get("body", b""))
                # Counted and logged before the last byte leaves, so whoever has the whole response sees it
                # counted. With a Content-Length that is the message that completes the body: a streamed
                # wrapper (Starlette's BaseHTTPMiddleware) sends the bytes with more_body and an empty end after.
                if not message.get("more_body", False) or (body_left is not None and body_left <= 0):
                    recorded = True
                    self._record(scope, status or 500, time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            status = status or 500
            raise
        except BaseException:  # cancelled: the client went away mid-request
            status = status or 499
            raise
        finally:
            if not recorded:
                self._record(scope, status or 500, time.perf_counter() - started)
            _session_id.reset(tokens[1])
            _request_id.reset(tokens[0])

    def _record(self, scope: Scope, status: int, duration_s: float) -> None:
        method = str(scope.get("method", "GET"))
        if self.route_metrics is not None:
            self.route_metrics.observe(route_template(scope), method, status, duration_s)
        path = str(scope.get("path", ""))
        if self.access_log and path not in self.quiet_paths:
            level = logging.WARNING if status >= 500 else logging.INFO
            access_logger.log(level, "%s %s -> %d in %.1f ms", method, path, status, duration_s * 1000)


# ---------------------------------------------------------------------------------------------- logging
class ContextFilter(logging.Filter):
    """Stamps ``request_id``/``session_id`` on each record (``extra=`` values given by the caller win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get()
        if getattr(record, "session_id", None) is None:
            record.session_id = _session_id.get()
        return True


PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s request_id=%(rid)s session_id=%(sid)s: %(message)s"
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "request_id",
    "session_id",
    "rid",
    "sid",
    "taskName",
    "color_message",
}  # uvicorn's ANSI-coloured duplicate of the message


def redact_query_secrets(text: str) -> str:
    """``text`` with the values of secret URL query parameters (``?api_key=K`` ...) shown as ``***``."""
    return _QUERY_SECRET.sub(r"\g<name>" + REDACTED, text) if "=" in text else text


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.rid = getattr(record, "request_id", None) or "-"
        record.sid = getattr(record, "session_id", None) or "-"
        return redact_query_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, session_id, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
            "session_id": getattr(record, "session_id", None),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return redact_query_secrets(json.dumps(out, ensure_ascii=False, default=str))


def configure_logging(level: str | int, json_logs: bool = False, *, stream: IO[str] | None = None) -> logging.Handler:
    """Install the one root handler (replacing one installed before by this function); returns it.

    Call once in a service's entrypoint and run uvicorn with ``log_config=None`` so its loggers use it too.
    """
    resolved = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(resolved, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_hindsight_observability", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._hindsight_observability = True  # type: ignore[attr-defined]
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if json_logs else PlainFormatter())
    root.addHandler(handler)
    root.setLevel(resolved)
    return handler


# ---------------------------------------------------------------------------------------------- settings
def is_secret_name(name: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()  # camelCase -> camel_case
    return any(part in SECRET_WORDS for part in re.split(r"[^a-z0-9]+", words))


def redact(value: Any, name: str = "") -> Any:
    """A JSON-friendly copy of ``value`` with secret-named fields as ``"***"`` (unset ones stay null)."""
    if isinstance(value, SecretStr | SecretBytes):
        return REDACTED
    if name and is_secret_name(name) and value is not None and not isinstance(value, Mapping):
        return REDACTED
    if isinstance(value, BaseModel):
        value = {k: getattr(value, k) for k in type(value).model_fields}
    if isinstance(value, Mapping):
        return {str(k): redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [redact(v, name) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\g<scheme>***@", value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)


def log_settings(
    log: logging.Logger, settings: BaseModel | Mapping[str, Any], *, title: str = "service"
) -> dict[str, Any]:
    """Log the resolved settings, secrets redacted, as one line (JSON after the title; also as the ``config``
    field of a JSON log line); returns what was logged."""
    shown = redact(settings)
    log.info("%s resolved config: %s", title, json.dumps(shown, sort_keys=True, default=str), extra={"config": shown})
    return shown
