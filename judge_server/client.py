"""JudgeClient: how the policy server calls the judge service (docs/CONTRACTS.md "Judge service").

``JudgeClient(base_url, api_key=None).judge(context, response, next_state, tasks, m=None) -> dict`` returns
the /v1/judge response JSON. Transport errors and 5xx are retried with capped exponential backoff plus
jitter within ``deadline_s``; then ``JudgeUnavailable`` is raised. A 4xx (bad input) is never retried and
raises ``JudgeRequestRejected``. A judged-but-failed task is NOT an exception: it comes back as
``status: judge_failed`` inside the dict, and the caller decides what to do with it.
"""

from __future__ import annotations

import random
import asyncio
from typing import Any

import httpx

from judge_server.errors import JudgeRequestRejected, JudgeUnavailable

__all__ = ["JudgeClient", "JudgeRequestRejected", "JudgeUnavailable"]


class JudgeClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_attempts: int = 5,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        deadline_s: float = 900.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.max_attempts = max_attempts
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.deadline_s = deadline_s
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s), trust_env=False, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> JudgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, body: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        loop = asyncio.get_running_loop()
        end = loop.time() + self.deadline_s
        last = "no attempt"
        for attempt in range(1, self.max_attempts + 1):
            try:
                resp = await self._http.post(self.base_url + path, json=body, headers=headers)
                if resp.status_code < 400:
                    return resp.json()
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise JudgeRequestRejected(_message(resp), resp.status_code)
                last = f"HTTP {resp.status_code}: {_message(resp)}"
            except httpx.TransportError as exc:
                last = repr(exc)
            backoff = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1)) + random.uniform(0, 0.1)
            if attempt == self.max_attempts or loop.time() + backoff > end:
                break
            await asyncio.sleep(backoff)
        raise JudgeUnavailable(f"judge service at {self.base_url} unreachable after {attempt} attempt(s): {last}")

    async def judge(
        self,
        context: list[dict[str, Any]],
        response: dict[str, Any],
        next_state: list[dict[str, Any]],
        tasks: list[str],
        m: int | None = None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"context": context, "response": response, "next_state": next_state, "tasks": tasks}
        if m is not None:
            body["m"] = m
        if policy is not None:
            body["policy"] = policy
        return await self._post("/v1/judge", body)

    async def judge_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return (await self._post("/v1/judge/batch", {"items": items}))["results"]


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except ValueError:
        return resp.text[:300]
