"""End-to-end: hindsight-judge (real uvicorn process) -> real sglang-router 0.3.2 -> two CPU dev engines.

Checks: with the regex constraint on, 100% of votes parse; each voting round is ONE engine
request (router's prometheus /generate counter == judge usage.engine_calls == rounds, + 1 shared-prefix
prefill when both tasks run); a killed engine
is survived (the router retries on the other one); all engines down -> judge_failed, score null, HTTP 200.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.testkit.servers import JudgeStack, llm_judge_stack

pytestmark = pytest.mark.e2e

REQ = {
    "context": [{"role": "user", "content": "Rename report.txt to summary.txt"}],
    "response": {"content": "Done.", "tool_calls": [{"function": {"name": "mv", "arguments": {"a": "report.txt"}}}]},
    "next_state": [{"role": "tool", "content": "mv: cannot stat 'report.txt': No such file"}],
}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JudgeStack]:
    args = ["--constrain-output", "--max-new-tokens", "64", "--request-deadline-s", "15", "--log-level", "warning"]
    env = {
        "HINDSIGHT_JUDGE_REASONING_MAX_CHARS": "24",
        "HINDSIGHT_JUDGE_HINT_MAX_CHARS": "60",
        "HINDSIGHT_JUDGE_ENGINE_MAX_ATTEMPTS": "3",
    }
    with llm_judge_stack(tiny_model_dir, tmp_path_factory.mktemp("judge-e2e"), engines=2, args=args, env=env) as s:
        yield s


def test_regex_votes_all_parse_and_one_request_per_round(stack: JudgeStack) -> None:
    before = stack.router_generate_count()
    total_calls = 0
    votes: list[int | None] = []
    for m in (3, 5):
        r = stack.post("/v1/judge", {**REQ, "tasks": ["prm", "hint"], "m": m})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["prm"]["status"] in ("ok", "tie") and len(body["prm"]["votes"]) == m
        assert len(body["hint"]["votes"]) == m and body["hint"]["status"] == "ok"
        votes += body["prm"]["votes"] + body["hint"]["votes"]
        # fixed policy: one n=m call per task, plus the one prefill of the prompts' shared prefix
        assert body["usage"]["engine_calls"] == 3
        assert body["prm"]["engine_calls"] == 2 and body["hint"]["engine_calls"] == 1
        total_calls += body["usage"]["engine_calls"]
        if body["hint"]["accepted"]:
            assert len(body["hint"]["hint"]) > 10
    assert None not in votes and len(votes) == 16  # 100% of constrained votes parse
    assert stack.router_generate_count() - before == total_calls == 6


def test_adaptive_rounds_match_engine_requests(stack: JudgeStack) -> None:
    before = stack.router_generate_count()
    r = stack.post("/v1/judge", {**REQ, "tasks": ["prm"], "m": 3, "policy": "adaptive"})
    body = r.json()
    assert body["prm"]["status"] in ("ok", "tie") and None not in body["prm"]["votes"]
    assert 2 <= len(body["prm"]["votes"]) <= 7
    assert stack.router_generate_count() - before == body["usage"]["engine_calls"] >= 1


def test_batch_and_metrics(stack: JudgeStack) -> None:
    r = stack.post("/v1/judge/batch", {"items": [{**REQ, "tasks": ["prm"]}] * 4})
    results = r.json()["results"]
    assert len(results) == 4 and all(x["prm"]["status"] in ("ok", "tie") for x in results)
    metrics = httpx.get(stack.judge.url + "/metrics", trust_env=False).text
    assert "hindsight_judge_votes_per_turn_bucket" in metrics
    assert "hindsight_judge_engine_call_seconds_bucket" in metrics


def test_killed_engine_survived_then_all_down_is_judge_failed(stack: JudgeStack) -> None:
    stack.engines[0].kill()
    for _ in range(4):  # round robin would hit the dead engine every other call
        r = stack.post("/v1/judge", {**REQ, "tasks": ["prm"]})
        assert r.status_code == 200 and r.json()["prm"]["status"] in ("ok", "tie"), r.text
    stack.engines[1].kill()
    r = stack.post("/v1/judge", {**REQ, "tasks": ["prm", "hint"]}, timeout_s=40)
    assert r.status_code == 200
    body = r.json()
    assert body["prm"]["status"] == "judge_failed" and body["prm"]["score"] is None and body["prm"]["reason"]
    assert body["hint"]["status"] == "judge_failed" and body["hint"]["accepted"] is False
    ready = httpx.get(stack.judge.url + "/ready", timeout=10, trust_env=False)
    assert ready.status_code == 503
