"""Service tests: the judge app in-process (ASGI) against a scripted fake engine (httpx.MockTransport),
used to count engine calls per voting round and to inject faults (5xx, timeouts, all down).

Contracts checked: one /generate per round with sampling_params.n; PRM and hint run concurrently;
engine errors retried within the deadline, then judge_failed with score null (HTTP 200); bad input 4xx;
Bearer key; OpenRLHF /get_reward and slime /slime/reward mappings; /ready; /metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engine.client import EngineClient, EngineTimeouts, RetryPolicy
from judge_server.app import create_app
from judge_server.settings import JudgeSettings

pytestmark = pytest.mark.unit

REQ = {
    "context": [{"role": "user", "content": "Convert 5 km to miles"}],
    "response": {"content": "5 km is about 3.1 miles."},
    "next_state": [{"role": "user", "content": "Thanks, that worked."}],
    "tasks": ["prm", "hint"],
}


class FakeEngine:
    """Answers /generate with scripted texts; records every request body."""

    def __init__(self, prm_texts: list[str], hint_texts: list[str] | None = None):
        self.prm = list(prm_texts)
        self.hint = list(hint_texts or [])
        self.requests: list[dict[str, Any]] = []
        self.prefix_requests: list[dict[str, Any]] = []  # the judge's shared-prefix prefills (max_new_tokens=0)
        self.fail_next = 0  # answer this many /generate calls with 503
        self.down = False
        self.delay_s = 0.0
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path in ("/health",):
            return httpx.Response(200, text="OK")
        if path in ("/model_info", "/get_model_info", "/readiness"):
            return httpx.Response(404, json={"error": "not found"})
        assert path == "/generate", path
        body = json.loads(request.content)
        if body["sampling_params"].get("max_new_tokens") == 0:
            self.prefix_requests.append(body)
            return httpx.Response(
                200,
                json={
                    "text": "",
                    "output_ids": [],
                    "meta_info": {
                        "prompt_tokens": 80,
                        "cached_tokens": 0,
                        "completion_tokens": 0,
                        "finish_reason": {"type": "length", "length": 0},
                    },
                },
            )
        self.requests.append(body)
        if self.fail_next > 0:
            self.fail_next -= 1
            return httpx.Response(503, json={"error": "overloaded"})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        prompt = body.get("text") or ""
        pool = self.hint if "HINT_START" in prompt else self.prm  # only the hint question names the markers
        n = body["sampling_params"].get("n", 1)
        items = []
        for _ in range(n):
            text = pool.pop(0) if pool else "no verdict"
            items.append(
                {
                    "text": text,
                    "output_ids": list(range(len(text.split()))),
                    "meta_info": {
                        "prompt_tokens": 100,
                        "completion_tokens": len(text.split()),
                        "finish_reason": {"type": "stop"},
                    },
                }
            )
        return httpx.Response(200, json=items if n > 1 else items[0])


@asynccontextmanager
async def judge_app(engine: FakeEngine, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = JudgeSettings(engine_url="http://engine", **{"request_deadline_s": 5.0, **overrides})
    client = EngineClient(
        "http://engine",
        transport=httpx.MockTransport(engine),
        timeouts=EngineTimeouts(connect_s=1, read_s=5),
        retry=RetryPolicy(
            max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=settings.request_deadline_s
        ),
    )
    app = create_app(settings, engine_client=client)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://judge") as c:
            yield c
    await client.aclose()


async def test_one_engine_call_per_round_with_n() -> None:
    eng = FakeEngine([r"ok \boxed{1}"] * 3, [r"\boxed{-1}"] * 3)
    async with judge_app(eng, m=3) as c:
        r = await c.post("/v1/judge", json=REQ)
    assert r.status_code == 200, r.text
    body = r.json()
    verdict = {k: body["prm"][k] for k in ("score", "status", "votes", "confidence", "reason")}
    assert verdict == {"score": 1, "status": "ok", "votes": [1, 1, 1], "confidence": 1.0, "reason": None}
    assert body["hint"]["accepted"] is False and body["hint"]["votes"] == [-1, -1, -1]
    assert len(eng.requests) == 2  # one call per task, n=3 each
    assert all(req["sampling_params"]["n"] == 3 for req in eng.requests)
    assert all(req["sampling_params"]["temperature"] == 0.6 for req in eng.requests)
    assert len(eng.prefix_requests) == 1  # the prompts' shared prefix, prefilled once before both tasks
    assert body["usage"] == {"engine_calls": 3, "prompt_tokens": 280, "cached_tokens": 0, "completion_tokens": 9}
    assert body["prm"]["engine_calls"] == 2 and body["prm"]["prompt_tokens"] == 180  # the prefix call counts here
    assert body["hint"]["engine_calls"] == 1 and body["hint"]["prompt_tokens"] == 100
    assert body["prompt_versions"]["prm"].startswith("prm_eval_v2@")


async def test_adaptive_policy_rounds() -> None:
    eng = FakeEngine([r"\boxed{1}", r"\boxed{-1}", r"\boxed{1}"])
    async with judge_app(eng) as c:
        r = await c.post("/v1/judge", json={**REQ, "tasks": ["prm"], "policy": "adaptive", "m": 3})
    assert r.json()["prm"]["votes"] == [1, -1, 1]
    assert [q["sampling_params"]["n"] for q in eng.requests] == [2, 1]


async def test_hint_selected_and_prompt_carries_context() -> None:
    eng = FakeEngine(
        [],
        [
            r"\boxed{1} [HINT_START]Give the exact value 3.107 miles.[HINT_END]",
            r"\boxed{1} [HINT_START]Be exact.[HINT_END]",
            r"\boxed{-1}",
        ],
    )
    async with judge_app(eng) as c:
        r = await c.post("/v1/judge", json={**REQ, "tasks": ["hint"]})
    hint = r.json()["hint"]
    assert hint["accepted"] and hint["hint"] == "Give the exact value 3.107 miles." and hint["status"] == "ok"
    assert "Convert 5 km to miles" in eng.requests[0]["text"]  # the judge sees the user's request


async def test_constrained_output_sends_regex_and_seed() -> None:
    eng = FakeEngine([r"\boxed{0}"] * 3)
    async with judge_app(eng, constrain_output=True, reasoning_max_chars=30, sampling_seed=7) as c:
        await c.post("/v1/judge", json={**REQ, "tasks": ["prm"]})
    sp = eng.requests[0]["sampling_params"]
    assert sp["regex"].endswith(r"\\boxed\{(1|0|-1)\}") and "{0,30}" in sp["regex"]
    assert sp["sampling_seed"] == 7


async def test_transient_5xx_is_retried() -> None:
    eng = FakeEngine([r"\boxed{-1}"] * 3)
    eng.fail_next = 2
    async with judge_app(eng) as c:
        r = await c.post("/v1/judge", json={**REQ, "tasks": ["prm"]})
    assert r.json()["prm"]["score"] == -1 and r.json()["prm"]["votes"] == [-1, -1, -1]


async def test_engine_down_is_judge_failed_not_zero() -> None:
    eng = FakeEngine([])
    eng.down = True
    async with judge_app(eng) as c:
        r = await c.post("/v1/judge", json=REQ)
        ready = await c.get("/ready")
        metrics = (await c.get("/metrics")).text
    assert r.status_code == 200
    body = r.json()
    assert body["prm"]["status"] == "judge_failed" and body["prm"]["score"] is None and body["prm"]["reason"]
    assert body["hint"]["status"] == "judge_failed" and body["hint"]["accepted"] is False
    assert ready.status_code == 503
    assert 'hindsight_judge_verdicts_total{status="judge_failed",task="prm"} 1.0' in metrics


async def test_deadline_gives_judge_failed() -> None:
    eng = FakeEngine([r"\boxed{1}"] * 3)
    eng.delay_s = 2.0
    async with judge_app(eng, request_deadline_s=0.3) as c:
        r = await c.post("/v1/judge", json={**REQ, "tasks": ["prm"]})
    prm = r.json()["prm"]
    assert prm["status"] == "judge_failed" and prm["score"] is None


async def test_concurrency_bound() -> None:
    eng = FakeEngine([r"\boxed{1}"] * 60, [r"\boxed{-1}"] * 60)
    eng.delay_s = 0.05
    async with judge_app(eng, max_concurrent_engine_calls=2) as c:
        r = await c.post("/v1/judge/batch", json={"items": [REQ] * 6})
    assert r.status_code == 200 and len(r.json()["results"]) == 6
    assert eng.max_in_flight <= 2 and len(eng.requests) == 12


async def test_empty_reply_is_judged_like_any_other_turn() -> None:
    """An empty reply is a valid request (never a 422): voted on like any other; the ``degenerate`` guard
    (on by default) then quarantines it, the votes kept for audit."""
    eng = FakeEngine([r"\boxed{-1}"] * 6)
    body = {**REQ, "response": {"content": "   "}, "tasks": ["prm"]}
    async with judge_app(eng, guards="degenerate=off") as c:
        r = await c.post("/v1/judge", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["prm"]["score"] == -1 and r.json()["prm"]["votes"] == [-1, -1, -1]
    async with judge_app(eng) as c:
        r = await c.post("/v1/judge", json=body)
    assert r.status_code == 200, r.text
    prm = r.json()["prm"]
    assert (prm["score"], prm["status"], prm["votes"]) == (None, "quarantined", [-1, -1, -1])


@pytest.mark.parametrize(
    "body,status",
    [
        ({"response": {"content": "x"}}, 422),  # next_state missing
        ({**REQ, "next_state": [{"role": "assistant", "content": "x"}]}, 422),  # wrong role
        ({**REQ, "tasks": ["score"]}, 422),
        ({**REQ, "tasks": []}, 422),
        ({**REQ, "m": 0}, 422),
        ({**REQ, "m": 99}, 400),
        ({**REQ, "context": [{"role": "user", "content": "x" * 300_000}] * 4}, 413),  # oversized
        ({**REQ, "unknown_field": 1}, 422),
    ],
)
async def test_bad_input_is_4xx_with_message(body: dict[str, Any], status: int) -> None:
    eng = FakeEngine([])
    async with judge_app(eng) as c:
        r = await c.post("/v1/judge", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert eng.requests == []


async def test_api_key() -> None:
    eng = FakeEngine([r"\boxed{1}"] * 3)
    async with judge_app(eng, api_key="sekret") as c:
        assert (await c.post("/v1/judge", json=REQ)).status_code == 401
        bad = await c.post("/v1/judge", json=REQ, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = await c.post("/v1/judge", json={**REQ, "tasks": ["prm"]}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_openrlhf_get_reward() -> None:
    eng = FakeEngine([r"\boxed{1}"] * 3 + [r"\boxed{-1}"] * 3)
    full = json.dumps({"context": [], "response": {"content": "B"}, "next_state": [{"role": "user", "content": "no"}]})
    async with judge_app(eng) as c:
        r = await c.post(
            "/get_reward",
            json={"query": ["Q: hi A: hello", full], "prompts": ["Q: hi A:", ""], "labels": ["thanks", None]},
        )
        assert r.status_code == 200, r.text
        assert r.json()["rewards"] == [1.0, -1.0] and r.json()["extra_logs"]["judge_ok"] == [1.0, 1.0]
        bad = await c.post("/get_reward", json={"query": ["no prompts given"]})
        assert bad.status_code == 400 and "prompts" in bad.json()["error"]["message"]
        eng.down = True
        failed = await c.post("/get_reward", json={"query": [full]})
        assert failed.status_code == 503  # the client retries; never null (crashes it), never a silent 0


async def test_slime_reward() -> None:
    eng = FakeEngine([r"\boxed{-1}"] * 3)
    async with judge_app(eng) as c:
        r = await c.post("/slime/reward", json={"prompt": "What is 2+2?", "response": "5", "label": "wrong, it's 4"})
        assert r.status_code == 200 and r.json()["reward"] == -1.0
        assert (await c.post("/slime/reward", json={"prompt": "x", "response": "y"})).status_code == 400
        eng.down = True
        r = await c.post("/slime/reward", json={"prompt": "x", "response": "y", "label": "ok"})
        assert r.status_code == 503


async def test_rules_backend_through_http() -> None:
    settings = JudgeSettings(backend="rules", m=3)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://judge") as c:
            r = await c.post(
                "/v1/judge",
                json={**REQ, "next_state": [{"role": "user", "content": "No, I wanted kilometres per hour."}]},
            )
            ready = await c.get("/ready")
    body = r.json()
    assert body["prm"]["score"] == -1 and body["prm"]["votes"] == [-1, -1, -1]
    assert body["hint"]["hint"] == "No, I wanted kilometres per hour." and body["hint"]["accepted"]
    assert body["prompt_versions"]["prm"].startswith("rules@") and body["usage"]["engine_calls"] == 0
    assert ready.status_code == 200


async def test_tokenizer_mode_sends_input_ids(tiny_model_dir: Callable[..., Any]) -> None:
    eng = FakeEngine([r"\boxed{1}"] * 3)
    async with judge_app(eng, tokenizer_path=str(tiny_model_dir)) as c:
        r = await c.post("/v1/judge", json={**REQ, "tasks": ["prm"]})
    assert r.json()["prm"]["score"] == 1
    req = eng.requests[0]
    assert "text" not in req and isinstance(req["input_ids"], list) and len(req["input_ids"]) > 50
