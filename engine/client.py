"""The one async client for SGLang engines (real SGLang 0.5.x, the CPU dev engine, or sglang-router).

Every Hindsight service talks to engines through this module only; it never knows which kind of
engine is behind the URL. Contract (../shared/reference/sglang-protocol.md §1-§3, §6):

- ``generate``/``generate_ids`` call ``POST /generate`` with ``input_ids`` (never re-tokenized text)
  and return one :class:`Generation` per sample (``n`` samples are prompt-major, as SGLang returns them).
- ``score`` asks for the log-probs of given response ids after a prompt in one prefill
  (``max_new_tokens=0``, ``logprob_start_len=len(prompt)-1``), drops the leading null entry and
  verifies that the returned token ids are exactly the response ids (else EngineBadResponse).
- Timeouts are explicit (connect/read/write/pool). Retries happen only on transport errors, 429 and
  5xx, with exponential backoff + jitter, bounded by attempts AND a total deadline; 4xx is never
  retried (EngineRejected). A deadline overrun raises EngineTimeout; exhausted retries raise
  EngineUnavailable. Services map these to HTTP once (see engine.errors).
- A graceful abort (``finish_reason.type == "abort"``, HTTP 200) is returned, not raised: callers that
  must survive a weight-sync pause resubmit with the tokens produced so far.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from engine.errors import (
    EngineBadResponse,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)
from engine.results import Generation, ScoredSequence, parse_generation  # re-exported: callers import them here

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# tenacity 9.2 renamed wait_exponential_jitter(initial=) to multiplier= (the old name warns); support both.
_BACKOFF_KW = "multiplier" if "multiplier" in inspect.signature(wait_exponential_jitter.__init__).parameters else "initial"


@dataclass(frozen=True)
class EngineTimeouts:
    """httpx timeouts; read is long because a generation can legitimately take minutes."""

    connect_s: float = 5.0
    read_s: float = 300.0
    write_s: float = 30.0
    pool_s: float = 30.0

    def to_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect_s, read=self.read_s, write=self.write_s, pool=self.pool_s)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry budget for one call: whichever of attempts or deadline runs out first ends it."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    jitter_s: float = 0.1
    deadline_s: float = 120.0


class _Retryable(Exception):
    """Internal marker: this attempt failed in a way another attempt may fix."""

    def __init__(self, error: EngineError):
        super().__init__(str(error))
        self.error = error


def _error_message(resp: httpx.Response) -> str:
    """SGLang returns {"error": str}, {"error": {"message": ...}} or OpenAI's {"message": ...}."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


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
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeouts = timeouts or EngineTimeouts()
        self.retry = retry or RetryPolicy()
        self._owns_http = http is None
        # trust_env=False: loopback engines must never be reached through a proxy from the environment.
        self._http = http or httpx.AsyncClient(
            timeout=self.timeouts.to_httpx(),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=False,
            transport=transport,
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
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _attempt(self, method: str, path: str, body: Any, admin: bool) -> httpx.Response:
        url = self.base_url + path
        try:
            resp = await self._http.request(method, url, json=body, headers=self._headers(admin))
        except httpx.TimeoutException as exc:
            raise _Retryable(EngineTimeout(f"engine call timed out: {exc!r}", url=url)) from exc
        except httpx.TransportError as exc:
            raise _Retryable(EngineUnavailable(f"engine unreachable: {exc!r}", url=url)) from exc
        if resp.status_code in RETRYABLE_STATUS:
            raise _Retryable(EngineUnavailable(_error_message(resp), url=url, status_code=resp.status_code))
        if resp.status_code >= 400:
            raise EngineRejected(_error_message(resp), url=url, status_code=resp.status_code)
        return resp

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
        deadline = self.retry.deadline_s if deadline_s is None else deadline_s
        last: list[EngineError] = []

        async def run() -> httpx.Response:
            policy = AsyncRetrying(
                stop=stop_after_attempt(self.retry.max_attempts if retry else 1),
                wait=wait_exponential_jitter(
                    **{_BACKOFF_KW: self.retry.initial_backoff_s}, max=self.retry.max_backoff_s, jitter=self.retry.jitter_s
                ),
                retry=retry_if_exception_type(_Retryable),
                reraise=True,
            )
            async for attempt in policy:
                with attempt:
                    try:
                        return await self._attempt(method, path, body, admin)
                    except _Retryable as exc:
                        last.append(exc.error)
                        logger.debug("retryable engine failure on %s%s: %s", self.base_url, path, exc.error)
                        raise
            raise AssertionError("unreachable")  # pragma: no cover

        try:
            async with asyncio.timeout(deadline):
                return await run()
        except TimeoutError as exc:
            cause = f"; last error: {last[-1]}" if last else ""
            raise EngineTimeout(
                f"{method} {path} did not finish within {deadline:.1f}s{cause}", url=self.base_url + path
            ) from exc
        except _Retryable as exc:
            err = exc.error
            if isinstance(err, EngineTimeout):
                raise err from exc
            raise EngineUnavailable(
                f"{method} {path} failed after {len(last)} attempt(s): {err.message}",
                url=err.url,
                status_code=err.status_code,
            ) from exc

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
            "input_ids": list(input_ids),
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

        Connection failures before the first byte are retried like any call; once bytes flow,
        a failure raises EngineUnavailable (the caller decides whether to resubmit).
        """
        body = dict(payload, stream=True)
        url = self.base_url + "/generate"
        deadline = self.retry.deadline_s if deadline_s is None else deadline_s
        attempts = 0
        while True:
            attempts += 1
            try:
                async with self._http.stream("POST", url, json=body, headers=self._headers(False)) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        err_cls = EngineUnavailable if resp.status_code in RETRYABLE_STATUS else EngineRejected
                        raise err_cls(_error_message(resp), url=url, status_code=resp.status_code)
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        chunk = json.loads(data)
                        if isinstance(chunk, dict) and "error" in chunk:
                            err = chunk["error"]
                            msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                            raise EngineRejected(msg, url=url)
                        yield chunk
                    return
            except (httpx.ConnectError, EngineUnavailable) as exc:
                if attempts >= self.retry.max_attempts or deadline <= 0:
                    if isinstance(exc, EngineError):
                        raise
                    raise EngineUnavailable(f"engine unreachable: {exc!r}", url=url) from exc
                backoff = min(self.retry.max_backoff_s, self.retry.initial_backoff_s * 2 ** (attempts - 1))
                backoff += random.uniform(0, self.retry.jitter_s)
                deadline -= backoff
                await asyncio.sleep(backoff)
            except httpx.TimeoutException as exc:
                raise EngineTimeout(f"stream timed out: {exc!r}", url=url) from exc
            except httpx.TransportError as exc:
                raise EngineUnavailable(f"stream broke: {exc!r}", url=url) from exc

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
        that position is SGLang's null and is dropped (protocol §1.5/§1.6). Never pads.
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
        result = ScoredSequence(token_ids=ids, logprobs=[float(x) for x in lps], weight_version=meta.get("weight_version"))
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

    async def wait_ready(self, deadline_s: float = 60.0, path: str = "/health", interval_s: float = 0.2) -> None:
        """Poll ``path`` until 200 (use ``/readiness`` for sglang-router); EngineTimeout after the deadline."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while loop.time() < end:
            if await self.health(path, timeout_s=min(2.0, deadline_s)):
                return
            await asyncio.sleep(interval_s)
        raise EngineTimeout(f"{self.base_url}{path} not ready within {deadline_s:.0f}s", url=self.base_url)

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
