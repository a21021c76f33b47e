"""The one async client for SGLang engines (real SGLang 0.5.x, the CPU dev engine, or sglang-router).

Every Hindsight service talks to engines through this module only; it never knows which kind of
engine is behind the URL. Contract:

- ``generate``/``generate_ids`` call ``POST /generate`` with ``input_ids`` (never re-tokenized text)
  and return one :class:`Generation` per sample (``n`` samples are prompt-major, as SGLang returns them).
- ``score`` asks for the log-probs of given response ids after a prompt in one prefill
  (``max_new_tokens=0``, ``logprob_start_len=len(prompt)-1``), drops the leading null entry and
  verifies that the returned token ids are exactly the response ids (else EngineBadResponse).
- Transport, retries and deadlines are engine.http_client's: explicit timeouts (connect/read/write/pool);
  retries only on transport errors, 408/429 and 5xx, with exponential backoff + jitter, bounded by attempts
  AND a total deadline that counts request time and backoff (``stream_generate`` included: opening, retries
  and every chunk read count against it); 4xx is never retried (EngineRejected). A deadline overrun, or
  retries whose last attempt timed out, raise EngineTimeout; other exhausted retries raise EngineUnavailable.
  Services map these to HTTP once (see engine.errors).
- ``event_hooks`` (e.g. request-id propagation) go to the httpx pool the client builds; a service that
  shares one pool across clients builds it with engine.http_client.build_async_http and passes ``http``.
- A graceful abort (``finish_reason.type == "abort"``, HTTP 200) is returned, not raised: callers that
  must survive a weight-sync pause resubmit with the tokens produced so far.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx

from engine import fastjson
from engine.errors import (
    EngineBadResponse,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)
from engine.http_client import (
    RETRYABLE_STATUS,
    CallError,
    CallFailed,
    CallRejected,
    CallTimedOut,
    EventHooks,
    RetryPolicy,
    bearer_headers,
    body_message,
    build_async_http,
    open_stream,
    send,
)
from engine.results import Generation, ScoredSequence, parse_generation  # re-exported: callers import them here

logger = logging.getLogger(__name__)

__all__ = ["RETRYABLE_STATUS", "EngineClient", "EngineTimeouts", "Generation", "RetryPolicy", "ScoredSequence"]


@dataclass(frozen=True)
class EngineTimeouts:
    """httpx timeouts; read is long because a generation can legitimately take minutes."""

    connect_s: float = 5.0
    read_s: float = 300.0
    write_s: float = 30.0
    pool_s: float = 30.0

    def to_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect_s, read=self.read_s, write=self.write_s, pool=self.pool_s)


class EngineClient:
    """Async client for one engine URL (an engine or a router). One instance per target, shared."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeouts: EngineTimeouts | None = None,
        retry: RetryPolicy | None = None,
        http: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 256,
        event_hooks: EventHooks | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeouts = timeouts or EngineTimeouts()
        self.retry = retry or RetryPolicy()
        if http is not None and event_hooks:
            raise ValueError("event_hooks belong to the shared pool: build it with them (build_async_http)")
        self._owns_http = http is None
        self._http = http or build_async_http(
            self.timeouts.to_httpx(), max_connections=max_connections, event_hooks=event_hooks, transport=transport
        )

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ transport
    def _headers(self, admin: bool) -> dict[str, str]:
        return bearer_headers((self.admin_api_key or self.api_key) if admin else self.api_key)

    def _body(self, body: Any, admin: bool) -> dict[str, Any]:
        """httpx arguments for a JSON body: encoded once by engine.fastjson (a whole prompt's ids), not per try."""
        headers = self._headers(admin)
        if body is None:
            return {"headers": headers}
        return {"content": fastjson.dumps_bytes(body), "headers": {**headers, "Content-Type": "application/json"}}

    def _engine_error(self, exc: CallError, method: str, path: str) -> EngineError:
        """The engine.errors class for one failed call (the single mapping from the client layer)."""
        if isinstance(exc, CallRejected):
            return EngineRejected(exc.message, url=exc.url, status_code=exc.status_code)
        if isinstance(exc, CallTimedOut):
            return EngineTimeout(exc.message, url=exc.url)
        if isinstance(exc, CallFailed) and exc.timed_out:
            return EngineTimeout(f"engine call timed out: {exc.message}", url=exc.url)
        return EngineUnavailable(
            f"{method} {path} failed after {exc.attempts} attempt(s): {exc.message}",
            url=exc.url,
            status_code=exc.status_code,
        )

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        admin: bool = False,
        deadline_s: float | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """Send one logical call with retries; raises only EngineError subclasses."""
        try:
            return await send(
                self._http,
                method,
                self.base_url + path,
                policy=self.retry,
                deadline_s=deadline_s,
                retry=retry,
                **self._body(body, admin),
            )
        except CallError as exc:
            raise self._engine_error(exc, method, path) from exc

    async def _json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        resp = await self.request(method, path, body, **kw)
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineBadResponse(f"{path} returned non-JSON: {resp.text[:200]!r}", url=str(resp.url)) from exc

    # ------------------------------------------------------------------ generation
    async def generate(self, payload: dict[str, Any], *, deadline_s: float | None = None) -> Any:
        """Raw ``POST /generate``; returns the decoded JSON (object or list)."""
        return await self._json("POST", "/generate", payload, deadline_s=deadline_s)

    async def generate_ids(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        deadline_s: float | None = None,
    ) -> list[Generation]:
        """Sample from token ids; returns ``sampling_params.get("n", 1)`` generations."""
        if not input_ids:
            raise EngineRejected("input_ids must not be empty")
        payload: dict[str, Any] = {
            "input_ids": input_ids if type(input_ids) is list else list(input_ids),  # a prompt is not copied
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "stream": False,
        }
        if top_logprobs_num:
            payload["top_logprobs_num"] = top_logprobs_num
        if rid:
            payload["rid"] = rid
        raw = await self.generate(payload, deadline_s=deadline_s)
        items = raw if isinstance(raw, list) else [raw]
        n = int(sampling_params.get("n", 1) or 1)
        if len(items) != n:
            raise EngineBadResponse(f"asked for n={n} samples, engine returned {len(items)}", url=self.base_url)
        return [parse_generation(item, return_logprob=return_logprob, url=self.base_url) for item in items]

    async def stream_generate(
        self, payload: dict[str, Any], *, deadline_s: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """``POST /generate`` with ``stream: true``; yields each SSE JSON chunk (SGLang sends cumulative chunks).

        Opening the stream is retried like any call; once bytes flow, a broken connection raises
        EngineUnavailable (the caller decides whether to resubmit). The deadline is total: opening, retries
        and every chunk read count against it (so does the time the caller spends between chunks); when it
        passes, EngineTimeout is raised and the connection closed.
        """
        body = dict(payload, stream=True)
        url = self.base_url + "/generate"
        deadline = self.retry.deadline_s if deadline_s is None else deadline_s
        end = asyncio.get_running_loop().time() + deadline
        async with AsyncExitStack() as stack:
            try:
                resp = await open_stream(
                    stack,
                    self._http,
                    "POST",
                    url,
                    policy=self.retry,
                    deadline_s=deadline,
                    **self._body(body, False),
                )
            except CallError as exc:
                raise self._engine_error(exc, "POST", "/generate") from exc
            lines = resp.aiter_lines()
            while True:
                try:
                    # Each read is bounded by what is left of the total deadline, not by a fresh one.
                    async with asyncio.timeout_at(end):
                        line = await anext(lines)
                except StopAsyncIteration:
                    return
                except TimeoutError as exc:
                    raise EngineTimeout(f"stream did not finish within {deadline:.1f}s", url=url) from exc
                except httpx.TimeoutException as exc:
                    raise EngineTimeout(f"stream timed out: {exc!r}", url=url) from exc
                except httpx.TransportError as exc:
                    raise EngineUnavailable(f"stream broke: {exc!r}", url=url) from exc
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    raise EngineRejected(body_message(chunk), url=url)
                yield chunk

    async def score(
        self,
        prompt_ids: list[int],
        response_ids: list[int],
        *,
        top_logprobs_num: int = 0,
        temperature: float = 1.0,
        deadline_s: float | None = None,
    ) -> ScoredSequence:
        """Log-probs of ``response_ids`` given ``prompt_ids`` in one prefill; verifies the ids.

        ``logprob_start_len = len(prompt) - 1`` so the first response token is scored too; the entry at
        that position is SGLang's null and is dropped Never pads.
        """
        if not prompt_ids or not response_ids:
            raise EngineRejected("score needs a non-empty prompt and response")
        payload: dict[str, Any] = {
            "input_ids": list(prompt_ids) + list(response_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1,
            "return_text_in_logprobs": False,
            "stream": False,
        }
        if top_logprobs_num:
            payload["top_logprobs_num"] = top_logprobs_num
        raw = await self.generate(payload, deadline_s=deadline_s)
        if isinstance(raw, list):
            raw = raw[0] if len(raw) == 1 else None
        meta = raw.get("meta_info") if isinstance(raw, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("input_token_logprobs"), list):
            raise EngineBadResponse("score: response has no meta_info.input_token_logprobs", url=self.base_url)
        entries = meta["input_token_logprobs"][1:]
        if len(entries) != len(response_ids):
            raise EngineBadResponse(
                f"score: expected {len(response_ids)} response log-probs, got {len(entries)}", url=self.base_url
            )
        ids = [int(e[1]) for e in entries]
        if ids != list(response_ids):
            raise EngineBadResponse("score: engine scored different token ids than the response", url=self.base_url)
        lps = [e[0] for e in entries]
        if any(lp is None for lp in lps):
            raise EngineBadResponse("score: engine returned a null log-prob inside the response", url=self.base_url)
        result = ScoredSequence(
            token_ids=ids, logprobs=[float(x) for x in lps], weight_version=meta.get("weight_version")
        )
        if top_logprobs_num:
            rows = (meta.get("input_top_logprobs") or [])[1:]
            if len(rows) != len(response_ids) or any(not r for r in rows):
                raise EngineBadResponse("score: top-k rows missing for some response positions", url=self.base_url)
            result.top_ids = [[int(t[1]) for t in row] for row in rows]
            result.top_logprobs = [[float(t[0]) for t in row] for row in rows]
        return result

    async def chat(self, payload: dict[str, Any], *, deadline_s: float | None = None) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (non-streaming), returned as decoded JSON."""
        return await self._json("POST", "/v1/chat/completions", payload, deadline_s=deadline_s)

    # ------------------------------------------------------------------ health and info
    async def health(self, path: str = "/health", timeout_s: float = 2.0) -> bool:
        """One probe, no retries: True on HTTP 200."""
        try:
            resp = await self._http.get(self.base_url + path, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` on engines; routers 0.3.2 only serve ``/get_model_info``."""
        try:
            return await self._json("GET", "/model_info", retry=False)
        except EngineRejected as exc:
            if exc.status_code != 404:
                raise
            return await self._json("GET", "/get_model_info")

    async def weight_version(self) -> str | None:
        info = await self.model_info()
        return info.get("weight_version")

    # ------------------------------------------------------------------ control plane (admin)
    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, deadline_s: float | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        result = await self._json("POST", "/update_weights_from_disk", body, admin=True, deadline_s=deadline_s)
        if not result.get("success", False):
            raise EngineRejected(f"update_weights_from_disk failed: {result.get('message')}", url=self.base_url)
        return result

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return await self._json("POST", "/pause_generation", {"mode": mode}, admin=True)

    async def continue_generation(self) -> dict[str, Any]:
        return await self._json("POST", "/continue_generation", {}, admin=True)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, admin=True)

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache", {}, admin=True)
