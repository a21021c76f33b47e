"""JudgeClient (used by the policy server): retries transport errors and 5xx within its budget, then raises
JudgeUnavailable; a 4xx is raised at once as JudgeRequestRejected; a judged answer comes back as its JudgeVerdicts record, and an answer off that schema raises JudgeBadResponse
(never retried, never a score).
Also the CLI's flag parsing (flags override env; unset flags fall through to the environment)."""

from __future__ import annotations

import httpx
import pytest

from engine.cli_settings import parse_settings
from engine.http_client import RetryPolicy
from engine.observability import bind_ids
from judge_server.client import JudgeBadResponse, JudgeClient, JudgeRequestRejected, JudgeUnavailable
from judge_server.settings import JudgeSettings

pytestmark = pytest.mark.unit

ARGS = ([{"role": "user", "content": "hi"}], {"content": "hello"}, [{"role": "user", "content": "thanks"}], ["prm"])


def client_for(handler) -> JudgeClient:
    return JudgeClient(
        "http://judge",
        api_key="k",
        transport=httpx.MockTransport(handler),
        retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02),
    )


async def test_retries_then_succeeds() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"prm": {"score": 1, "status": "ok"}})

    async with client_for(handler) as c:
        out = await c.judge(*ARGS, m=3)
    assert out.prm is not None and out.prm.score == 1 and len(calls) == 3
    assert calls[-1].headers["authorization"] == "Bearer k"
    assert b'"m":3' in calls[-1].content.replace(b" ", b"")


async def test_unavailable_after_retries() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with client_for(handler) as c:
        with pytest.raises(JudgeUnavailable, match="3 attempt"):
            await c.judge(*ARGS)


async def test_4xx_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(422, json={"error": {"message": "next_state: field required"}})

    async with client_for(handler) as c:
        with pytest.raises(JudgeRequestRejected, match="next_state"):
            await c.judge(*ARGS)
    assert calls == [1]


def test_cli_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HINDSIGHT_JUDGE_M", "5")
    monkeypatch.setenv("HINDSIGHT_JUDGE_PORT", "9999")
    s = parse_settings(JudgeSettings, ["--backend", "rules", "--port", "1234", "--constrain-output"])
    level = s.log_level
    assert (s.backend, s.port, s.m, s.constrain_output, s.host, level) == ("rules", 1234, 5, True, "127.0.0.1", "info")
    with pytest.raises(ValueError, match="engine_url"):
        JudgeSettings(backend="llm")


@pytest.mark.parametrize(
    "body",
    [
        {"prm": {"score": "1", "status": "ok"}},  # a string score
        {"prm": {"score": 1, "status": "great"}},  # a status outside the verdict statuses
        ["not", "an", "object"],
    ],
)
async def test_an_answer_off_the_verdict_schema_raises_bad_response_once(body) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, json=body)

    async with client_for(handler) as c:
        with pytest.raises(JudgeBadResponse, match="off the JudgeVerdicts schema"):
            await c.judge(*ARGS)
    assert len(calls) == 1


async def test_caller_ids_go_to_the_judge() -> None:
    """The policy server's background judging binds the session (dispatch); its judge calls carry it."""
    seen: list[httpx.Headers] = []
    extra: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"prm": {"score": 1, "status": "ok"}})

    async def own_hook(request: httpx.Request) -> None:
        extra.append(request.url.path)

    async with client_for(handler) as client:
        with bind_ids(request_id="req-7", session_id="sess-7"):
            await client.judge(*ARGS)
        await client.judge(*ARGS)  # outside any bound ids: none are invented
    hooked = JudgeClient("http://judge", transport=httpx.MockTransport(handler), event_hooks={"request": [own_hook]})
    async with hooked:
        with bind_ids(session_id="sess-8"):
            await hooked.judge(*ARGS)
    assert (seen[0].get("x-request-id"), seen[0].get("x-session-id")) == ("req-7", "sess-7")
    assert "x-session-id" not in seen[1] and "x-request-id" not in seen[1]
    assert seen[2].get("x-session-id") == "sess-8" and extra == ["/v1/judge"]  # the caller's hooks still run
