"""JudgeClient: how the policy server calls the judge service (docs/CONTRACTS.md "Judge service").

``JudgeClient(base_url, api_key=None).judge(context, response, next_state, tasks, m=None, tools=None) -> JudgeVerdicts``
returns the /v1/judge answer as its record (engine.records); an answer off that schema raises
``JudgeBadResponse``. Transport and retries are engine.http_client's: transport errors, 408/429 and
5xx are retried with capped exponential backoff plus jitter, the whole call (requests and backoff) bounded
by the total ``deadline_s``; then ``JudgeUnavailable`` is raised. A 4xx (bad input) is never retried and
raises ``JudgeRequestRejected``. A judged-but-failed task is NOT an exception: it comes back as
``status: judge_failed`` inside the verdicts, and the caller decides what to do with it.

The caller's request and session ids (engine.observability.bind_ids) go with every call as ``X-Request-ID``
/ ``X-Session-Id``, before any ``event_hooks`` of the caller's: the judge's log lines of a policy server's
background judging carry the session they judge.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import ValidationError

from engine.http_client import (
    CallError,
    CallRejected,
    EventHooks,
    RetryPolicy,
    bearer_headers,
    build_async_http,
    send,
)
from engine.observability import propagate_request_id
from engine.records import JudgeVerdicts
from engine.validation import describe_validation_errors
from judge_server.errors import JudgeBadResponse, JudgeRequestRejected, JudgeUnavailable

__all__ = ["JudgeBadResponse", "JudgeClient", "JudgeRequestRejected", "JudgeUnavailable"]


def _verdicts(answer: Any) -> JudgeVerdicts:
    try:
        return JudgeVerdicts.model_validate(answer)
    except ValidationError as exc:
        raise JudgeBadResponse(
            f"judge answer off the JudgeVerdicts schema: {describe_validation_errors(exc.errors())}"
        ) from exc


# A judge call votes m times on a long prompt: a request may take minutes, and the budget covers a judge restart.
JUDGE_RETRY = RetryPolicy(max_attempts=5, initial_backoff_s=0.2, max_backoff_s=5.0, jitter_s=0.1, deadline_s=900.0)


class JudgeClient:
    """Async client for one judge service; owns its pool (closed by :meth:`aclose`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retry: RetryPolicy = JUDGE_RETRY,
        event_hooks: EventHooks | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.retry = retry
        self._http = build_async_http(
            httpx.Timeout(timeout_s, connect=connect_timeout_s),
            max_connections=100,
            max_keepalive=20,
            event_hooks={
                **(event_hooks or {}),
                "request": [propagate_request_id, *(event_hooks or {}).get("request", [])],
            },
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> JudgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, body: Any) -> Any:
        try:
            resp = await send(
                self._http,
                "POST",
                self.base_url + path,
                policy=self.retry,
                json=body,
                headers=bearer_headers(self.api_key),
            )
        except CallRejected as exc:
            raise JudgeRequestRejected(exc.message, exc.status_code or 400) from exc
        except CallError as exc:
            last = f"HTTP {exc.status_code}: {exc.message}" if exc.status_code is not None else exc.message
            raise JudgeUnavailable(
                f"judge service at {self.base_url} unreachable after {exc.attempts} attempt(s): {last}"
            ) from exc
        return resp.json()

    async def judge(
        self,
        context: list[dict[str, Any]],
        response: dict[str, Any],
        next_state: list[dict[str, Any]],
        tasks: list[str],
        m: int | None = None,
        policy: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> JudgeVerdicts:
        body: dict[str, Any] = {"context": context, "response": response, "next_state": next_state, "tasks": tasks}
        if m is not None:
            body["m"] = m
        if policy is not None:
            body["policy"] = policy
        if tools is not None:  # the turn's offered tools, for the judge's malformed_tool_call guard
            body["tools"] = tools
        return _verdicts(await self._post("/v1/judge", body))

    async def judge_batch(self, items: list[dict[str, Any]]) -> list[JudgeVerdicts]:
        answer = await self._post("/v1/judge/batch", {"items": items})
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise JudgeBadResponse("judge batch answer has no results list")
        return [_verdicts(item) for item in results]
