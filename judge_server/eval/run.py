"""The HTTP client side of ``hindsight-judge-eval``: every labelled step through a running judge's ``POST /v1/judge``.

Contract:
- Each step is one ``judge_server.schemas.JudgeRequest`` (``tasks: ["prm"]``, ``m`` votes): the step's context,
  response and next state (dataset.LabelledStep), plus the trajectory's ``tools`` when the request schema has a
  ``tools`` field. A step with no next-state text (the episode ended with it) gets, with ``final_step="marker"``,
  one user message holding the neutral end-of-episode marker (prompts/templates/eval_episode_end_v1.txt); with
  ``"skip"`` it is not sent and has no verdict (status ``skipped``).
- The verdict is ``prm.score`` when ``prm.status == "ok"``; any other status (tie, no_valid_votes, judge_failed,
  abstained, quarantined, ...), an HTTP error after retries or an answer without a ``prm`` is no verdict, with
  the status tallied (``http_<code>``, ``transport_error``, ``bad_response``).
- Retries are the one client layer's (engine.http_client): transport errors, 408, 429 and 5xx are retried
  with capped exponential backoff and jitter within ``step_deadline_s`` per step; any other 4xx never is. At
  most ``concurrency`` requests are in flight, on one shared ``httpx.AsyncClient`` with an explicit timeout.
- Resume: every answered step (any prm status but judge_failed) is appended to the cache file as one JSON line,
  flushed at once, keyed by a hash of the judge URL, the step's identity and the exact request body (so ``m``,
  the final-step rule and the request shape are in the key); a re-run sends only the steps not in the cache.
  Failures (judge_failed, HTTP errors, transport errors, answers without a ``prm``) are not cached: a re-run
  asks again. A torn last line (a killed run) is ignored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError
from tqdm import tqdm

from engine.http_client import (
    CallFailed,
    CallRejected,
    CallTimedOut,
    RetryPolicy,
    bearer_headers,
    build_async_http,
    send,
)
from judge_server.eval.dataset import LabelledStep, StepKey
from judge_server.schemas import JudgeRequest
from prompts.templates import load_template

FinalStep = Literal["marker", "skip"]
FINAL_STEP_TEMPLATE = "eval_episode_end_v1"
STATUS_SKIPPED = "skipped"
STATUS_OK = "ok"
# A judge_failed answer is the judge's engine failing, not a verdict on the step: a re-run should ask again.
_UNCACHED_STATUSES = frozenset({"judge_failed", "bad_response", "transport_error"})


class EvalRunError(RuntimeError):
    """The judge cannot be used at all (e.g. its /ready is unreachable)."""


@dataclass(frozen=True)
class JudgeTarget:
    """Where and how to judge: the service URL and key, votes per step, the final-step rule, and the client limits."""

    url: str
    api_key: str | None = None
    m: int = 3
    final_step: FinalStep = "marker"
    concurrency: int = 4
    read_timeout_s: float = 600.0  # one request votes m times on a long prompt
    connect_timeout_s: float = 5.0
    step_deadline_s: float = 900.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_attempts: int = 8

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            max_attempts=self.max_attempts,
            initial_backoff_s=self.initial_backoff_s,
            max_backoff_s=self.max_backoff_s,
            jitter_s=self.initial_backoff_s,
            deadline_s=self.step_deadline_s,
        )


@dataclass(frozen=True)
class StepVerdict:
    trajectory_id: int
    message_index: int
    score: int | None  # None: no verdict
    status: str

    @property
    def key(self) -> StepKey:
        return (self.trajectory_id, self.message_index)


@dataclass(frozen=True)
class JudgeInfo:
    """What the judge's ``/ready`` says about itself (backend and prompt versions only with the key)."""

    ready: bool
    backend: str | None
    prompt_versions: Mapping[str, str]


@dataclass(frozen=True)
class RunResult:
    verdicts: tuple[StepVerdict, ...]
    info: JudgeInfo
    sent: int  # steps sent to the judge in this run
    from_cache: int
    wall_s: float
    cache_path: Path
    final_step_marker: str  # the marker template's version, or "skip"


class _Ready(BaseModel):
    model_config = ConfigDict(extra="ignore")

    ready: bool = False
    backend: str | None = None
    prompt_versions: dict[str, str] | None = None


class _Prm(BaseModel):
    model_config = ConfigDict(extra="ignore")

    score: int | None = None
    status: str


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prm: _Prm | None = None


def final_step_marker() -> str:
    """The neutral end-of-episode next-state text sent for a step nothing followed."""
    return load_template(FINAL_STEP_TEMPLATE).content.strip()


def request_body(step: LabelledStep, m: int, final_step: FinalStep) -> dict[str, Any] | None:
    """The ``/v1/judge`` body of ``step`` (validated against JudgeRequest), or None when the rule skips it."""
    next_state: list[Mapping[str, Any]] = list(step.next_state)
    if not step.has_next_state:
        if final_step == "skip":
            return None
        next_state.append({"role": "user", "content": final_step_marker()})
    body: dict[str, Any] = {
        "context": list(step.context),
        "response": dict(step.response),
        "next_state": next_state,
        "tasks": ["prm"],
        "m": m,
    }
    # The tools field arrives with a later JudgeRequest; older judges would answer 422 to an unknown field.
    if step.tools is not None and "tools" in JudgeRequest.model_fields:
        body["tools"] = list(step.tools)
    return JudgeRequest.model_validate(body).model_dump(mode="json", exclude_none=True)


def cache_key(url: str, step: LabelledStep, body: Mapping[str, Any]) -> str:
    blob = json.dumps(
        {"url": url.rstrip("/"), "step": list(step.key), "body": body}, sort_keys=True, ensure_ascii=False
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def read_cache(path: Path) -> dict[str, StepVerdict]:
    """The cached verdicts by key; unreadable lines (a run killed mid-write) are skipped."""
    out: dict[str, StepVerdict] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            out[row["key"]] = StepVerdict(row["trajectory_id"], row["message_index"], row["score"], row["status"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _append(stream: IO[str], key: str, verdict: StepVerdict) -> None:
    row = {
        "key": key,
        "trajectory_id": verdict.trajectory_id,
        "message_index": verdict.message_index,
        "score": verdict.score,
        "status": verdict.status,
    }
    stream.write(json.dumps(row) + "\n")
    stream.flush()  # a killed run keeps every step judged so far


def cacheable(status: str) -> bool:
    """Whether a verdict with ``status`` is the judge's answer on the step (cached) rather than a failure."""
    return status not in _UNCACHED_STATUSES and not status.startswith("http_")


def verdict_of(step: LabelledStep, answer: Any) -> StepVerdict:
    """The step's verdict from a 2xx ``/v1/judge`` answer (module contract)."""
    try:
        prm = _Answer.model_validate(answer).prm
    except ValidationError:
        prm = None
    if prm is None:
        return StepVerdict(*step.key, None, "bad_response")
    ok = prm.status == STATUS_OK and prm.score in (1, 0, -1)
    return StepVerdict(*step.key, prm.score if ok else None, prm.status)


async def judge_info(client: httpx.AsyncClient, target: JudgeTarget) -> JudgeInfo:
    try:
        resp = await client.get(target.url.rstrip("/") + "/ready", headers=bearer_headers(target.api_key))
        ready = _Ready.model_validate(resp.json())
    except httpx.HTTPError as exc:
        raise EvalRunError(f"judge at {target.url} unreachable: {exc!r}") from exc
    except (ValueError, ValidationError) as exc:
        raise EvalRunError(f"judge at {target.url}: /ready answered {resp.status_code} without JSON") from exc
    return JudgeInfo(ready=ready.ready, backend=ready.backend, prompt_versions=ready.prompt_versions or {})


async def _judge_one(
    client: httpx.AsyncClient, target: JudgeTarget, step: LabelledStep, body: Mapping[str, Any]
) -> StepVerdict:
    url = target.url.rstrip("/") + "/v1/judge"
    try:
        resp = await send(
            client, "POST", url, policy=target.retry_policy(), json=body, headers=bearer_headers(target.api_key)
        )
    except CallRejected as exc:  # bad input: retrying cannot help
        return StepVerdict(*step.key, None, f"http_{exc.status_code}")
    except CallFailed as exc:
        status = f"http_{exc.status_code}" if exc.status_code is not None else "transport_error"
        return StepVerdict(*step.key, None, status)
    except CallTimedOut:
        return StepVerdict(*step.key, None, "transport_error")
    except httpx.HTTPError:  # not retried: a redirect loop, an undecodable body
        return StepVerdict(*step.key, None, "bad_response")
    try:
        answer = resp.json()
    except ValueError:
        return StepVerdict(*step.key, None, "bad_response")
    return verdict_of(step, answer)


async def judge_steps(
    steps: Sequence[LabelledStep],
    target: JudgeTarget,
    cache_path: Path,
    *,
    progress: bool,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Judge every step not already in ``cache_path`` and return all verdicts in ``steps`` order
    (``transport``: a test seam, e.g. ``httpx.MockTransport``)."""
    started = time.monotonic()
    bodies = {step.key: request_body(step, target.m, target.final_step) for step in steps}
    keys = {step.key: cache_key(target.url, step, body) for step in steps if (body := bodies[step.key]) is not None}
    cached = read_cache(cache_path)
    verdicts: dict[StepKey, StepVerdict] = {}
    for step in steps:
        if bodies[step.key] is None:
            verdicts[step.key] = StepVerdict(*step.key, None, STATUS_SKIPPED)
        elif keys[step.key] in cached:
            verdicts[step.key] = cached[keys[step.key]]
    todo = [s for s in steps if s.key not in verdicts]
    from_cache = sum(1 for s in steps if s.key in keys and keys[s.key] in cached)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    timeout = httpx.Timeout(target.read_timeout_s, connect=target.connect_timeout_s)
    gate = asyncio.Semaphore(target.concurrency)
    bar = tqdm(total=len(steps), initial=len(steps) - len(todo), unit="step", file=sys.stderr, disable=not progress)
    with cache_path.open("a", encoding="utf-8") as stream:
        async with build_async_http(timeout, max_connections=target.concurrency, transport=transport) as client:
            info = await judge_info(client, target)

            async def one(step: LabelledStep) -> None:
                body = bodies[step.key]
                assert body is not None  # skipped steps never reach here
                async with gate:
                    verdict = await _judge_one(client, target, step, body)
                verdicts[step.key] = verdict
                if cacheable(verdict.status):
                    _append(stream, keys[step.key], verdict)
                bar.update(1)

            await asyncio.gather(*(one(step) for step in todo))
    bar.close()
    return RunResult(
        verdicts=tuple(verdicts[s.key] for s in steps),
        info=info,
        sent=len(todo),
        from_cache=from_cache,
        wall_s=time.monotonic() - started,
        cache_path=cache_path,
        final_step_marker=load_template(FINAL_STEP_TEMPLATE).version if target.final_step == "marker" else "skip",
    )
