"""engine.observability: request/session ids, log records, JSON lines, redaction, route-template metrics.

Contract (module docstring of engine/observability.py): X-Request-ID accepted when 1-128 visible ASCII chars,
else a fresh uuid4 hex; echoed; held in a contextvar for that request only (isolated across concurrent
requests, reset afterwards); X-Session-Id likewise (1-256 printable chars); every log record carries both
ids; secret-named settings show "***"; route metrics are labelled with route templates, never raw paths.
Apps are tiny FastAPI apps driven in-process through httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import types
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from pydantic_settings import BaseSettings

from engine.observability import (
    REDACTED,
    UNMATCHED_ROUTE,
    RequestContextMiddleware,
    RouteMetrics,
    bind_ids,
    configure_logging,
    current_request_id,
    current_session_id,
    is_secret_name,
    log_settings,
    propagate_request_id,
    redact,
    redact_query_secrets,
)

pytestmark = pytest.mark.unit
log = logging.getLogger("tests.observability")
HEX32 = re.compile(r"[0-9a-f]{32}")


def make_app(registry: CollectorRegistry | None = None) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")  # answers before routing, like an auth check
    async def deny(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.headers.get("x-deny"):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/ids")
    async def ids(delay_s: float = 0.0) -> dict[str, str | None]:
        seen = current_request_id()
        await asyncio.sleep(delay_s)  # other requests run meanwhile; our id must not change
        log.info("inside handler")
        return {"request_id": seen, "after_sleep": current_request_id(), "session_id": current_session_id()}

    @app.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"item_id": item_id}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaboom")

    app.add_middleware(
        RequestContextMiddleware, route_metrics=RouteMetrics(registry, "t") if registry is not None else None
    )
    return app


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = configure_logging("info", stream=stream)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


# ------------------------------------------------------------------------------------------ request ids
async def test_client_request_id_is_accepted_and_echoed() -> None:
    async with client(make_app()) as c:
        r = await c.get("/ids", headers={"X-Request-ID": "abc-123_XY.z"})
    assert r.headers["x-request-id"] == "abc-123_XY.z"
    assert r.json()["request_id"] == "abc-123_XY.z"


async def test_missing_request_id_is_generated_and_echoed() -> None:
    async with client(make_app()) as c:
        r1, r2 = await c.get("/ids"), await c.get("/ids")
    assert HEX32.fullmatch(r1.headers["x-request-id"])
    assert r1.json()["request_id"] == r1.headers["x-request-id"]
    assert r1.headers["x-request-id"] != r2.headers["x-request-id"]


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "tab\there", "caf\u00e9", ""])
async def test_invalid_request_id_is_replaced(bad: str) -> None:
    async with client(make_app()) as c:
        r = await c.get("/ids", headers={"X-Request-ID": bad.encode("latin-1")})
    assert HEX32.fullmatch(r.headers["x-request-id"]), r.headers["x-request-id"]
    assert r.json()["request_id"] == r.headers["x-request-id"]


async def test_request_id_of_128_chars_is_kept() -> None:
    rid = "a" * 128
    async with client(make_app()) as c:
        r = await c.get("/ids", headers={"X-Request-ID": rid})
    assert r.headers["x-request-id"] == rid


@pytest.mark.parametrize(
    ("header", "expected"), [("sess 1", "sess 1"), ("  s2 ", "s2"), ("x" * 257, None), ("bad\x7f", None)]
)
async def test_session_id_from_header(header: str, expected: str | None) -> None:
    async with client(make_app()) as c:
        r = await c.get("/ids", headers={"X-Session-Id": header.encode("latin-1")})
    assert r.json()["session_id"] == expected


async def test_ids_isolated_across_concurrent_requests_and_reset_after() -> None:
    async with client(make_app()) as c:
        rids = [f"req-{i}" for i in range(20)]
        # Decreasing delays: the requests finish in the reverse order they started, fully interleaved.
        rs = await asyncio.gather(
            *(
                c.get(
                    "/ids", params={"delay_s": 0.002 * (20 - i)}, headers={"X-Request-ID": rid, "X-Session-Id": f"s{i}"}
                )
                for i, rid in enumerate(rids)
            )
        )
        # Sequential requests run in THIS task (ASGITransport): nothing may leak into our context.
        await c.get("/ids", headers={"X-Request-ID": "sequential"})
    for i, (rid, r) in enumerate(zip(rids, rs, strict=True)):
        assert r.json() == {"request_id": rid, "after_sleep": rid, "session_id": f"s{i}"}
        assert r.headers["x-request-id"] == rid
    assert current_request_id() is None and current_session_id() is None


async def test_echo_on_response_from_a_middleware_before_routing() -> None:
    async with client(make_app()) as c:
        r = await c.get("/ids", headers={"X-Request-ID": "denied-1", "X-Deny": "1"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "denied-1"


async def test_streaming_body_is_not_buffered() -> None:
    """Pure ASGI: the first chunk reaches the server while the app still holds the second one back."""
    release = asyncio.Event()

    async def streaming_app(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"second", "more_body": False})

    sent: list[dict] = []
    first_chunk = asyncio.Event()

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)
        if message.get("body") == b"first":
            first_chunk.set()

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "GET", "path": "/s", "headers": [], "query_string": b""}
    task = asyncio.create_task(RequestContextMiddleware(streaming_app)(scope, receive, send))
    await asyncio.wait_for(first_chunk.wait(), timeout=2)
    assert not task.done()
    release.set()
    await asyncio.wait_for(task, timeout=2)
    assert [m.get("body") for m in sent[1:]] == [b"first", b"second"]
    assert HEX32.fullmatch(dict(sent[0]["headers"])[b"x-request-id"].decode())


# ------------------------------------------------------------------------------------------ logging
async def test_log_records_carry_request_and_session_ids(log_stream: io.StringIO) -> None:
    log.info("outside any request")
    async with client(make_app()) as c:
        await c.get("/ids", headers={"X-Request-ID": "rid-7", "X-Session-Id": "sess-7"})
    lines = log_stream.getvalue().splitlines()
    outside = next(ln for ln in lines if "outside any request" in ln)
    inside = next(ln for ln in lines if "inside handler" in ln)
    access = next(ln for ln in lines if "GET /ids -> 200" in ln)
    assert "request_id=- session_id=-" in outside
    assert "request_id=rid-7 session_id=sess-7" in inside
    assert "request_id=rid-7 session_id=sess-7" in access


async def test_json_log_lines(log_stream: io.StringIO) -> None:
    configure_logging("info", json_logs=True, stream=log_stream)  # replaces the plain handler of the fixture
    async with client(make_app()) as c:
        await c.get("/ids", headers={"X-Request-ID": "json-1", "X-Session-Id": "js"})
    with bind_ids(request_id="bg-1"):
        log.info("with extra %d", 5, extra={"turn_index": 3})
    try:
        raise ValueError("bad value")
    except ValueError:
        log.exception("failed")
    records = [json.loads(ln) for ln in log_stream.getvalue().splitlines()]  # every line is JSON
    assert len([r for r in records if r["message"] == "inside handler"]) == 1
    inside = next(r for r in records if r["message"] == "inside handler")
    assert (inside["request_id"], inside["session_id"], inside["level"], inside["logger"]) == (
        "json-1",
        "js",
        "INFO",
        "tests.observability",
    )
    extra = next(r for r in records if r["message"] == "with extra 5")
    assert (extra["request_id"], extra["session_id"], extra["turn_index"]) == ("bg-1", None, 3)
    failed = next(r for r in records if r["message"] == "failed")
    assert "ValueError: bad value" in failed["exc"] and failed["request_id"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", failed["ts"])


def test_configure_logging_is_idempotent_and_checks_the_level() -> None:
    root = logging.getLogger()
    level, before = root.level, list(root.handlers)
    try:
        configure_logging("debug", stream=io.StringIO())
        h = configure_logging("warning", stream=io.StringIO())
        assert [x for x in root.handlers if x not in before] == [h] and root.level == logging.WARNING
        with pytest.raises(ValueError, match="unknown log level"):
            configure_logging("loud")
    finally:
        for x in [x for x in root.handlers if x not in before]:
            root.removeHandler(x)
        root.setLevel(level)


@pytest.mark.parametrize("json_logs", [False, True])
def test_handler_masks_secret_query_parameters(json_logs: bool) -> None:
    root = logging.getLogger()
    level, before = root.level, list(root.handlers)
    out = io.StringIO()
    try:
        configure_logging("info", json_logs=json_logs, stream=out)
        logging.getLogger("demo").info("POST %s -> 200", "http://h:1/get_reward?api_key=k-123&n=2")
        logging.getLogger("demo").info("GET http://h/x?a=1&token=t-9 and max_new_tokens=5")
    finally:
        for x in [x for x in root.handlers if x not in before]:
            root.removeHandler(x)
        root.setLevel(level)
    text = out.getvalue()
    assert "k-123" not in text and "t-9" not in text
    assert "api_key=***&n=2" in text and "token=***" in text and "max_new_tokens=5" in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/get_reward?api_key=abc", "/get_reward?api_key=***"),
        ("/r?x=1&API_KEY=abc&y=2", "/r?x=1&API_KEY=***&y=2"),
        ('{"url": "http://h/r?key=abc"}', '{"url": "http://h/r?key=***"}'),
        ("monkey=1 key=abc ?keys=abc", "monkey=1 key=abc ?keys=abc"),  # not a query parameter / not a secret name
    ],
)
def test_redact_query_secrets(text: str, expected: str) -> None:
    assert redact_query_secrets(text) == expected


# ------------------------------------------------------------------------------------------ redaction
class DemoSettings(BaseSettings):
    api_key: str | None = "sk-live-1"
    admin_api_key: str | None = None
    hf_token: str = "hf_abc"
    db_password: SecretStr = SecretStr("pw")
    max_new_tokens: int = 64
    tokenizer_path: str = "/models/tok"
    engine_url: str = "http://user:pa55@10.0.0.1:30000/v1"
    extra_headers: dict[str, str] = {"Authorization": "Bearer zzz", "X-Trace": "ok"}
    worker_urls: list[str] = ["http://a:1", "http://u:p@b:2"]


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api_key", True),
        ("admin_api_key", True),
        ("hf_token", True),
        ("client_secret", True),
        ("password", True),
        ("apiKey", True),
        ("hfToken", True),
        ("APIKEY", True),
        ("max_new_tokens", False),
        ("tokenizer_path", False),
        ("keywords", False),
        ("Authorization", True),
        ("monkey", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_log_settings_redacts_secrets(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tests.observability")
    shown = log_settings(log, DemoSettings(), title="demo")
    assert shown == {
        "api_key": REDACTED,
        "admin_api_key": None,
        "hf_token": REDACTED,
        "db_password": REDACTED,
        "max_new_tokens": 64,
        "tokenizer_path": "/models/tok",
        "engine_url": "http://***@10.0.0.1:30000/v1",
        "extra_headers": {"Authorization": REDACTED, "X-Trace": "ok"},
        "worker_urls": ["http://a:1", "http://***@b:2"],
    }
    [record] = [r for r in caplog.records if r.name == "tests.observability"]
    text = record.getMessage()
    assert text.startswith("demo resolved config: ")
    assert json.loads(text.removeprefix("demo resolved config: ")) == shown
    assert record.config == shown  # a structured field of JSON log lines
    for secret in ("sk-live-1", "hf_abc", "pw", "pa55", "zzz"):
        assert secret not in text


def test_redact_plain_mapping() -> None:
    assert redact({"nested": {"secret": "s", "n": 1}, "token": None}) == {
        "nested": {"secret": REDACTED, "n": 1},
        "token": None,
    }


# ------------------------------------------------------------------------------------------ route metrics
async def test_route_metrics_use_templates_methods_and_status() -> None:
    registry = CollectorRegistry()
    async with client(make_app(registry)) as c:
        for path in ("/items/1", "/items/2", "/items/3?x=1"):
            assert (await c.get(path)).status_code == 200
        assert (await c.get("/items/abc")).status_code == 422
        assert (await c.get("/no/such/path/42")).status_code == 404
        assert (await c.request("FROB", "/items/1")).status_code == 405
        assert (await c.get("/items/9", headers={"X-Deny": "1"})).status_code == 401
        with pytest.raises(RuntimeError, match="kaboom"):
            await c.get("/boom")

    def count(route: str, method: str, status: str) -> float | None:
        return registry.get_sample_value("t_http_requests_total", {"route": route, "method": method, "status": status})

    assert count("/items/{item_id}", "GET", "200") == 3
    assert count("/items/{item_id}", "GET", "422") == 1
    assert count(UNMATCHED_ROUTE, "GET", "404") == 1
    assert count("/items/{item_id}", "OTHER", "405") == 1
    assert count("/items/{item_id}", "GET", "401") == 1  # answered before routing, still the template
    assert count("/boom", "GET", "500") == 1
    assert (
        registry.get_sample_value(
            "t_http_request_duration_seconds_count", {"route": "/items/{item_id}", "method": "GET", "status": "200"}
        )
        == 3
    )
    routes = {s.labels["route"] for m in registry.collect() for s in m.samples if "route" in s.labels}
    assert routes == {"/items/{item_id}", UNMATCHED_ROUTE, "/boom"}  # no raw URL ever becomes a label


# ------------------------------------------------------------------------------------------ propagation
async def test_ids_propagate_to_upstream_calls() -> None:
    upstream = make_app()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=upstream),
        base_url="http://up",
        event_hooks={"request": [propagate_request_id]},
    ) as up:
        with bind_ids(request_id="from-caller", session_id="sess-9"):
            inside = (await up.get("/ids")).json()
        outside = (await up.get("/ids")).json()
    assert (inside["request_id"], inside["session_id"]) == ("from-caller", "sess-9")
    assert HEX32.fullmatch(outside["request_id"]) and outside["session_id"] is None


@pytest.mark.parametrize(
    ("headers", "messages"),
    [
        ([], [(b"part", True), (b"end", False)]),  # the last body message carries the last byte
        # Starlette's BaseHTTPMiddleware streams a Content-Length response: every byte with more_body, then an
        # empty end; the client has the whole response before that end is sent
        ([(b"content-length", b"7")], [(b"part", True), (b"end", True), (b"", False)]),
    ],
)
async def test_a_response_is_counted_and_logged_before_its_last_byte_leaves(
    log_stream: io.StringIO, headers: list, messages: list
) -> None:
    """Whoever has the whole response finds it on /metrics and in the access log (no read-after-response race)."""
    registry = CollectorRegistry()
    seen_with_last_byte: list[tuple[float | None, bool]] = []
    total = sum(len(body) for body, _ in messages)
    sent = 0

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 201, "headers": list(headers)})
        for body, more in messages:
            await send({"type": "http.response.body", "body": body, "more_body": more})

    async def send(message):  # type: ignore[no-untyped-def]
        nonlocal sent
        if message["type"] == "http.response.body" and message.get("body") and sent < total:
            sent += len(message["body"])
            if sent == total:  # this message completes the body the client reads
                count = registry.get_sample_value(
                    "t_http_requests_total", {"route": "/r", "method": "POST", "status": "201"}
                )
                seen_with_last_byte.append((count, "POST /r -> 201" in log_stream.getvalue()))

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "http.request", "body": b"", "more_body": False}

    route = types.SimpleNamespace(path="/r")  # as Starlette's router leaves the matched route in the scope
    scope = {"type": "http", "method": "POST", "path": "/r", "headers": [], "query_string": b"", "route": route}
    metrics = RouteMetrics(registry, "t")
    await RequestContextMiddleware(app, route_metrics=metrics)(scope, receive, send)
    assert seen_with_last_byte == [(1.0, True)]
    assert registry.get_sample_value("t_http_requests_total", {"route": "/r", "method": "POST", "status": "201"}) == 1
