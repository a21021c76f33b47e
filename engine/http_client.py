"""The one HTTP client layer of Hindsight: retry policy, retryable statuses, error-body parsing, pool factory.

Every outbound HTTP call of every service (engine client, judge client, the trainer's policy/admin client,
the run report's fetcher) goes through this module, so they all retry the same way:

- What is retried: transport errors (refused, reset, timed out) and the statuses in ``RETRYABLE_STATUS``
  (408, 429, 5xx gateway/overload answers). Any other status >= 400 is the caller's mistake and is never
  retried: it raises :class:`CallRejected` with the server's message (:func:`error_message`).
- How: one :class:`RetryPolicy` (attempts, capped exponential backoff plus additive jitter, total deadline),
  run by tenacity. Whichever of attempts or deadline runs out first ends the call: exhausted attempts raise
  :class:`CallFailed` (its ``timed_out`` says whether the last attempt was a timeout), a passed deadline
  :class:`CallTimedOut`.
- The deadline is total: it counts request time AND backoff sleeps.
  Async calls (:func:`send`, :func:`open_stream`): the whole call, every attempt included, runs under one
  ``asyncio.timeout``, so it ends within ``deadline_s`` (plus event-loop scheduling), however slow the server.
  Sync calls (:func:`send_sync`, the trainer is a sync program and cannot cancel a blocking read): no attempt
  starts and no backoff sleep ends after the deadline, so a call ends within ``deadline_s`` plus ONE request
  timeout at most; callers that need a tighter bound size the request timeout accordingly.
- Pools: :func:`build_async_http` / :func:`build_sync_http` build the one shared client of a process with
  explicit timeouts, ``trust_env=False`` (loopback services are never reached through an env proxy) and the
  caller's ``event_hooks`` (e.g. request-id propagation), so no service rebuilds a pool to add a hook.

Each client maps :class:`CallRejected` / :class:`CallFailed` / :class:`CallTimedOut` to its own error tree
(engine.errors, judge_server.errors, trainer.lease_client) in one place.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential_jitter,
)

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_MESSAGE_CHARS = 500
EventHooks = Mapping[str, Sequence[Callable[..., Any]]]
T = TypeVar("T")
# tenacity 9.2 renamed wait_exponential_jitter(initial=) to multiplier= (the old name warns); support both.
_BACKOFF_KW = (
    "multiplier" if "multiplier" in inspect.signature(wait_exponential_jitter.__init__).parameters else "initial"
)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry budget of one logical call: whichever of attempts or deadline runs out first ends it.

    Backoff before attempt k+1 is ``min(max_backoff_s, initial_backoff_s * 2**(k-1) + uniform(0, jitter_s))``.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    jitter_s: float = 0.1
    deadline_s: float = 120.0

    def _wait(self) -> Any:
        return wait_exponential_jitter(
            **{_BACKOFF_KW: self.initial_backoff_s}, max=self.max_backoff_s, jitter=self.jitter_s
        )


# ---------------------------------------------------------------------------------------------- errors
class CallError(Exception):
    """Base of the failures of one logical call; each client maps these to its own error tree."""

    def __init__(self, message: str, *, url: str, status_code: int | None = None, attempts: int = 0):
        super().__init__(message)
        self.message = message
        self.url = url
        self.status_code = status_code
        self.attempts = attempts


class CallRejected(CallError):
    """The server answered a non-retryable status (a 4xx): retrying the same request cannot help."""


class CallFailed(CallError):
    """Every attempt failed retryably (``timed_out``: the last one by a timeout); ``message`` is the last error's."""

    def __init__(
        self, message: str, *, url: str, status_code: int | None = None, attempts: int = 0, timed_out: bool = False
    ):
        super().__init__(message, url=url, status_code=status_code, attempts=attempts)
        self.timed_out = timed_out


class CallTimedOut(CallError):
    """The call's total deadline passed; ``last_error`` is the last failed attempt's message, if any."""

    def __init__(self, message: str, *, url: str, deadline_s: float, last_error: str | None = None, attempts: int = 0):
        super().__init__(message, url=url, attempts=attempts)
        self.deadline_s = deadline_s
        self.last_error = last_error


class _AttemptFailed(Exception):
    """One attempt failed in a way another attempt may fix (internal to the retry loop)."""

    def __init__(self, message: str, *, status_code: int | None = None, timed_out: bool = False):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.timed_out = timed_out

    def describe(self) -> str:
        return f"HTTP {self.status_code}: {self.message}" if self.status_code is not None else self.message


# ---------------------------------------------------------------------------------------------- parsing
def error_message(resp: httpx.Response, limit: int = MAX_MESSAGE_CHARS) -> str:
    """The server's message from an error response, whatever its shape.

    OpenAI ``{"error": {"message": M}}``, SGLang ``{"error": M}``, FastAPI ``{"detail": M}`` (a string, an
    object with ``message``, or a list of validation errors), ``{"message": M}``, else the (truncated) text.
    """
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:limit] or resp.reason_phrase
    return body_message(body, limit)


def body_message(body: Any, limit: int = MAX_MESSAGE_CHARS) -> str:
    """The message of an error body already parsed from JSON (the shapes :func:`error_message` reads); also
    what an SGLang stream's ``{"error": ...}`` chunk says."""
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if key not in body:
                continue
            value = body[key]
            if isinstance(value, dict):
                return str(value.get("message") or value)[:limit]
            return str(value)[:limit]
    return str(body)[:limit]


def _check(resp: httpx.Response) -> httpx.Response:
    """The response if 2xx/3xx; raise _AttemptFailed for a retryable status, CallRejected for any other."""
    if resp.status_code in RETRYABLE_STATUS:
        raise _AttemptFailed(error_message(resp), status_code=resp.status_code)
    if resp.status_code >= 400:
        raise CallRejected(error_message(resp), url=str(resp.request.url), status_code=resp.status_code)
    return resp


def _transport_failure(exc: httpx.TransportError) -> _AttemptFailed:
    if isinstance(exc, httpx.TimeoutException):
        return _AttemptFailed(f"timed out: {exc!r}", timed_out=True)
    return _AttemptFailed(f"unreachable: {exc!r}")


def _exhausted(url: str, failure: _AttemptFailed, attempts: int) -> CallFailed:
    return CallFailed(
        failure.message, url=url, status_code=failure.status_code, attempts=attempts, timed_out=failure.timed_out
    )


# ---------------------------------------------------------------------------------------------- async
async def _run_async(
    policy: RetryPolicy,
    attempt: Callable[[], Awaitable[T]],
    *,
    method: str,
    url: str,
    deadline_s: float | None,
    retry: bool,
) -> T:
    """Run ``attempt`` under the policy and one total deadline (see the module docstring)."""
    deadline = policy.deadline_s if deadline_s is None else deadline_s
    failures: list[_AttemptFailed] = []

    async def attempt_logged() -> T:
        try:
            return await attempt()
        except _AttemptFailed as exc:
            failures.append(exc)
            logger.debug("retryable failure of %s %s (attempt %d): %s", method, url, len(failures), exc.describe())
            raise

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.max_attempts if retry else 1),
        wait=policy._wait(),
        retry=retry_if_exception_type(_AttemptFailed),
        reraise=True,
    )
    try:
        async with asyncio.timeout(deadline):
            return await retrying(attempt_logged)
    except TimeoutError as exc:
        last = failures[-1].describe() if failures else None
        cause = f"; last error: {last}" if last else ""
        raise CallTimedOut(
            f"{method} {httpx.URL(url).path} did not finish within {deadline:.1f}s{cause}",
            url=url,
            deadline_s=deadline,
            last_error=last,
            attempts=len(failures) + 1,
        ) from exc
    except _AttemptFailed as exc:
        raise _exhausted(url, exc, len(failures)) from exc


async def send(
    http: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    policy: RetryPolicy,
    deadline_s: float | None = None,
    retry: bool = True,
    **request: Any,
) -> httpx.Response:
    """One logical call (``request`` goes to ``http.request``); the 2xx/3xx response or a CallError."""

    async def attempt() -> httpx.Response:
        try:
            resp = await http.request(method, url, **request)
        except httpx.TransportError as exc:
            raise _transport_failure(exc) from exc
        return _check(resp)

    return await _run_async(policy, attempt, method=method, url=url, deadline_s=deadline_s, retry=retry)


async def open_stream(
    stack: AsyncExitStack,
    http: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    policy: RetryPolicy,
    deadline_s: float | None = None,
    **request: Any,
) -> httpx.Response:
    """Open a streamed response (headers read, body not) with retries; it closes with ``stack``.

    Only opening is retried: once the caller reads the body, a failure is the caller's to handle.
    """

    async def attempt() -> httpx.Response:
        inner = AsyncExitStack()
        try:
            resp = await inner.enter_async_context(http.stream(method, url, **request))
            if resp.status_code >= 400:
                await resp.aread()
            _check(resp)
        except httpx.TransportError as exc:
            await inner.aclose()
            raise _transport_failure(exc) from exc
        except BaseException:
            await inner.aclose()
            raise
        stack.push_async_exit(inner)
        return resp

    return await _run_async(policy, attempt, method=method, url=url, deadline_s=deadline_s, retry=True)


# ---------------------------------------------------------------------------------------------- sync
def send_sync(
    http: httpx.Client, method: str, url: str, *, policy: RetryPolicy, deadline_s: float | None = None, **request: Any
) -> httpx.Response:
    """Blocking twin of :func:`send`: ends within the deadline plus one request timeout (module docstring)."""
    deadline = policy.deadline_s if deadline_s is None else deadline_s
    failures: list[_AttemptFailed] = []

    def attempt() -> httpx.Response:
        try:
            return _check(http.request(method, url, **request))
        except httpx.TransportError as exc:
            failure = _transport_failure(exc)
        except _AttemptFailed as exc:
            failure = exc
        failures.append(failure)
        logger.warning("%s %s attempt %d failed (%s)", method, url, len(failures), failure.describe())
        raise failure

    # stop_before_delay: a backoff sleep that would end past the deadline is not taken, nor is its attempt.
    retrying = Retrying(
        stop=stop_after_attempt(policy.max_attempts) | stop_before_delay(deadline),
        wait=policy._wait(),
        retry=retry_if_exception_type(_AttemptFailed),
        reraise=True,
    )
    try:
        return retrying(attempt)
    except _AttemptFailed as exc:
        raise _exhausted(url, exc, len(failures)) from exc


# ---------------------------------------------------------------------------------------------- pools
def build_async_http(
    timeout: httpx.Timeout,
    *,
    max_connections: int = 256,
    max_keepalive: int | None = None,
    event_hooks: EventHooks | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    **kw: Any,
) -> httpx.AsyncClient:
    """The shared async pool of a process: explicit timeouts, sized limits, no env proxy, the caller's hooks."""
    return httpx.AsyncClient(
        timeout=timeout,
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections if max_keepalive is None else max_keepalive,
        ),
        trust_env=False,
        event_hooks={k: list(v) for k, v in (event_hooks or {}).items()},
        transport=transport,
        **kw,
    )


def build_sync_http(
    timeout: httpx.Timeout,
    *,
    event_hooks: EventHooks | None = None,
    transport: httpx.BaseTransport | None = None,
    **kw: Any,
) -> httpx.Client:
    """The blocking pool of a sync program (the trainer, the report): same rules as :func:`build_async_http`."""
    return httpx.Client(
        timeout=timeout,
        trust_env=False,
        transport=transport,
        event_hooks={k: list(v) for k, v in (event_hooks or {}).items()},
        **kw,
    )


def bearer_headers(key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <key>`` when a key is set, else no header."""
    return {"Authorization": f"Bearer {key}"} if key else {}
