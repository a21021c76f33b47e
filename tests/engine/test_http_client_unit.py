"""engine.http_client: the one retry policy, retryable-status set, error-body parser and pool factory.

Contract under test (faults injected with httpx.MockTransport, no sockets):
- ``error_message`` reads OpenAI ``{"error": {"message"}}``, SGLang ``{"error": str}``, FastAPI ``{"detail"}``,
  ``{"message"}`` and plain-text bodies.
- Transport errors, 408/429 and 5xx are retried up to ``max_attempts``; any other 4xx is never retried
  (CallRejected); exhausted retries raise CallFailed with the last error (``timed_out`` when it was a timeout).
- The deadline is total. Async calls end within ``deadline_s`` even against a server that is slow AND failing
  (request time counts, not only backoff sleeps), stream_generate included; sync calls end within
  ``deadline_s`` plus one request's duration.
- Event hooks are a constructor argument of the clients.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine.client import EngineClient
from engine.errors import EngineRejected, EngineTimeout, EngineUnavailable
from engine.http_client import (
    RETRYABLE_STATUS,
    CallFailed,
    CallRejected,
    CallTimedOut,
    RetryPolicy,
    build_async_http,
    build_sync_http,
    error_message,
    send,
    send_sync,
)
from judge_server.client import JudgeClient, JudgeUnavailable

pytestmark = pytest.mark.unit

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02, jitter_s=0.0, deadline_s=5.0)
# A slow-then-failing server: each attempt takes SLOW_S and ends 503; retries are (nearly) free.
SLOW_S = 0.3
DEADLINE_S = 0.5
MANY = RetryPolicy(max_attempts=50, initial_backoff_s=0.01, max_backoff_s=0.01, jitter_s=0.0, deadline_s=DEADLINE_S)
# What a loaded 2-core machine may add on top of a deadline. Without the deadline these calls take
# MANY.max_attempts * SLOW_S = 15 s, so a bound of DEADLINE_S + SLOW_S + SLACK_S (3.8 s) still tells them apart.
SLACK_S = 3.0
WITHIN_S = DEADLINE_S + SLOW_S + SLACK_S


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (
            httpx.Response(400, json={"error": {"message": "bad temperature", "type": "invalid_request_error"}}),
            "bad temperature",
        ),
        (httpx.Response(400, json={"error": "unknown field `max_tokens`"}), "unknown field `max_tokens`"),
        (httpx.Response(404, json={"detail": "unknown lease L9"}), "unknown lease L9"),
        (httpx.Response(422, json={"detail": {"message": "m too large"}}), "m too large"),
        (
            httpx.Response(422, json={"detail": [{"loc": ["body", "m"], "msg": "too big"}]}),
            "[{'loc': ['body', 'm'], 'msg': 'too big'}]",
        ),
        (httpx.Response(500, json={"message": "boom"}), "boom"),
        (httpx.Response(502, text="bad gateway"), "bad gateway"),
        (httpx.Response(503, text=""), "Service Unavailable"),
        (httpx.Response(500, json=["x"]), "['x']"),
        (httpx.Response(500, json={"other": 1}), "{'other': 1}"),
    ],
)
def test_error_message_reads_every_body_shape(response: httpx.Response, expected: str) -> None:
    assert error_message(response) == expected


def test_error_message_is_truncated() -> None:
    assert error_message(httpx.Response(500, text="x" * 2000)) == "x" * 500


def test_retryable_statuses() -> None:
    assert {408, 429, 500, 502, 503, 504} == RETRYABLE_STATUS


def _async_http(handler) -> httpx.AsyncClient:
    return build_async_http(httpx.Timeout(5.0), transport=httpx.MockTransport(handler))


def _answering(calls: list[httpx.Request], status: int, body: dict):
    """A MockTransport handler that records each request in ``calls`` and answers ``status`` with ``body``."""

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(status, json=body)

    return handler


@pytest.mark.parametrize("status", sorted(RETRYABLE_STATUS))
async def test_retryable_status_is_retried_then_call_failed(status: int) -> None:
    calls: list[httpx.Request] = []
    async with _async_http(_answering(calls, status, {"error": "busy"})) as http:
        with pytest.raises(CallFailed) as info:
            await send(http, "GET", "http://svc.test/x", policy=FAST)
    assert len(calls) == 4 and info.value.attempts == 4
    assert (info.value.status_code, info.value.message, info.value.timed_out) == (status, "busy", False)


@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 422])
async def test_other_4xx_is_never_retried(status: int) -> None:
    calls: list[httpx.Request] = []
    async with _async_http(_answering(calls, status, {"detail": "no"})) as http:
        with pytest.raises(CallRejected) as info:
            await send(http, "GET", "http://svc.test/x", policy=FAST)
    assert len(calls) == 1 and info.value.status_code == status and info.value.message == "no"


async def test_transport_errors_are_retried_and_a_last_timeout_is_flagged() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        raise httpx.ReadTimeout("slow", request=request)

    async with _async_http(handler) as http:
        with pytest.raises(CallFailed) as info:
            await send(http, "GET", "http://svc.test/x", policy=FAST)
    assert len(calls) == 4 and info.value.timed_out and info.value.status_code is None


async def test_recovers_when_a_retry_succeeds() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503) if len(calls) < 3 else httpx.Response(200, json={"ok": True})

    async with _async_http(handler) as http:
        resp = await send(http, "GET", "http://svc.test/x", policy=FAST)
    assert resp.json() == {"ok": True} and len(calls) == 3


async def _slow_503(request: httpx.Request) -> httpx.Response:
    await asyncio.sleep(SLOW_S)
    return httpx.Response(503, json={"error": "overloaded"})


async def test_async_deadline_counts_request_time_not_only_backoff() -> None:
    """50 attempts of 0.3 s each would take 15 s; the 0.5 s deadline ends the call inside it."""
    async with _async_http(_slow_503) as http:
        started = time.monotonic()
        with pytest.raises(CallTimedOut) as info:
            await send(http, "POST", "http://svc.test/generate", policy=MANY)
        elapsed = time.monotonic() - started
    assert elapsed < WITHIN_S, elapsed
    assert info.value.last_error == "HTTP 503: overloaded" and info.value.deadline_s == DEADLINE_S


async def test_engine_call_on_a_slow_failing_engine_is_an_engine_timeout_within_the_deadline() -> None:
    async with EngineClient("http://engine.test", retry=MANY, transport=httpx.MockTransport(_slow_503)) as client:
        started = time.monotonic()
        with pytest.raises(EngineTimeout, match="did not finish within 0.5s; last error: HTTP 503: overloaded"):
            await client.generate({"input_ids": [1]})
        assert time.monotonic() - started < WITHIN_S


async def test_stream_generate_deadline_covers_opening_retries() -> None:
    async with EngineClient("http://engine.test", retry=MANY, transport=httpx.MockTransport(_slow_503)) as client:
        started = time.monotonic()
        with pytest.raises(EngineTimeout):
            async for _ in client.stream_generate({"input_ids": [1]}):
                pass
        assert time.monotonic() - started < WITHIN_S


class _DripStream(httpx.AsyncByteStream):
    """An SSE body that sends one chunk every SLOW_S seconds, forever."""

    async def __aiter__(self):
        while True:
            yield b'data: {"text": "x", "meta_info": {}}\n\n'
            await asyncio.sleep(SLOW_S)


async def test_stream_generate_deadline_covers_the_body() -> None:
    """Each chunk arrives well inside the read timeout; the total deadline still ends the stream."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_DripStream(), headers={"content-type": "text/event-stream"})

    async with EngineClient("http://engine.test", retry=MANY, transport=httpx.MockTransport(handler)) as client:
        started = time.monotonic()
        chunks = []
        with pytest.raises(EngineTimeout, match="stream did not finish within 0.5s"):
            async for chunk in client.stream_generate({"input_ids": [1]}):
                chunks.append(chunk)
        assert time.monotonic() - started < WITHIN_S
    assert len(chunks) >= 1


async def test_stream_generate_retries_opening_and_rejects_4xx() -> None:
    calls = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"error": "busy"})
        return httpx.Response(200, text='data: {"text": "a"}\n\ndata: [DONE]\n\n')

    async with EngineClient("http://engine.test", retry=FAST, transport=httpx.MockTransport(flaky)) as client:
        assert [c async for c in client.stream_generate({"input_ids": [1]})] == [{"text": "a"}]
    assert len(calls) == 3

    def bad(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "input_ids must not be empty"})

    async with EngineClient("http://engine.test", retry=FAST, transport=httpx.MockTransport(bad)) as client:
        with pytest.raises(EngineRejected, match="must not be empty"):
            async for _ in client.stream_generate({"input_ids": []}):
                pass

    def error_chunk(request: httpx.Request) -> httpx.Response:  # SGLang reports a mid-stream failure as a chunk
        body = 'data: {"text": "a"}\n\ndata: {"error": {"message": "KV cache exhausted", "code": 503}}\n\n'
        return httpx.Response(200, text=body)

    async with EngineClient("http://engine.test", retry=FAST, transport=httpx.MockTransport(error_chunk)) as client:
        seen = []
        with pytest.raises(EngineRejected, match=r"^KV cache exhausted \[http"):
            async for chunk in client.stream_generate({"input_ids": [1]}):
                seen.append(chunk)
        assert seen == [{"text": "a"}]

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, json={"error": "no workers"})

    async with EngineClient("http://engine.test", retry=FAST, transport=httpx.MockTransport(down)) as client:
        with pytest.raises(EngineUnavailable, match="after 4 attempt"):
            async for _ in client.stream_generate({"input_ids": [1]}):
                pass


async def test_judge_client_deadline_is_total() -> None:
    client = JudgeClient(
        "http://judge.test",
        retry=RetryPolicy(max_attempts=50, initial_backoff_s=0.01, max_backoff_s=0.01, deadline_s=DEADLINE_S),
        transport=httpx.MockTransport(_slow_503),
    )
    async with client:
        started = time.monotonic()
        with pytest.raises(JudgeUnavailable, match="unreachable"):
            await client.judge([], {"content": "x"}, [], ["prm"])
        assert time.monotonic() - started < WITHIN_S


def test_sync_deadline_is_bounded_by_deadline_plus_one_request() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        time.sleep(SLOW_S)
        return httpx.Response(503, json={"detail": "draining"})

    with build_sync_http(httpx.Timeout(5.0), transport=httpx.MockTransport(handler)) as http:
        started = time.monotonic()
        with pytest.raises(CallFailed) as info:
            send_sync(http, "GET", "http://svc.test/x", policy=MANY)
        elapsed = time.monotonic() - started
    assert elapsed < WITHIN_S, elapsed  # deadline_s plus the one request in flight when it passed
    assert info.value.status_code == 503 and info.value.message == "draining" and len(calls) == info.value.attempts >= 2


async def test_event_hooks_are_a_constructor_argument() -> None:
    seen: list[str] = []

    async def hook(request: httpx.Request) -> None:
        seen.append(request.url.path)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"weight_version": "7"})

    async with EngineClient(
        "http://engine.test", transport=httpx.MockTransport(handler), event_hooks={"request": [hook]}
    ) as client:
        assert await client.weight_version() == "7"
    assert seen == ["/model_info"]
    async with build_async_http(httpx.Timeout(1.0)) as shared:
        with pytest.raises(ValueError, match="shared pool"):
            EngineClient("http://engine.test", http=shared, event_hooks={"request": [hook]})
