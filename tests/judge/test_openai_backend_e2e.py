"""The judge's ``openai`` backend end to end: hindsight-judge (real process) -> an OpenAI-compatible chat endpoint.

Contract (judge_server/openai_backend.py, docs/JUDGE_BACKENDS.md):
- against the dev engine's own ``/v1/chat/completions`` (SGLang's OpenAI shape, ``n`` and ``regex``
  honoured): one round of m votes is ONE request with ``n = m`` carrying the template's regex, every vote
  parses, the key comes from ``--api-key-file``, ``--base-url`` may end in ``/v1``; cost fields are the
  endpoint's ``usage``;
- against a stub that lacks ``n`` and refuses constraint fields: the constraint is dropped after the 400,
  the votes come from concurrent ``n = 1`` requests, each unparseable answer is re-asked once and then
  parses; hints are extracted the same way; usage counts every successful request;
- an endpoint that is down ends in ``judge_failed`` (never a score) within the request deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.testkit.openai_stub import start_openai_stub
from tests.testkit.procs import ManagedProcess, free_port, start_dev_engine
from tests.testkit.servers import start_judge, start_openai_judge

pytestmark = pytest.mark.e2e

ITEM = {
    "context": [{"role": "user", "content": "Please rename report.txt to summary.txt in ~/docs."}],
    "response": {"content": "Renamed it."},
    "next_state": [{"role": "user", "content": "Thanks, that worked."}],
}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("judge-openai")


@pytest.fixture(scope="module")
def key_file(log_dir: Path) -> Path:
    path = log_dir / "endpoint.key"
    path.write_text("stub-key\n")
    return path


@pytest.fixture(scope="module")
def dev_endpoint(tiny_model_dir: Path, log_dir: Path) -> Iterator[ManagedProcess]:
    mp = start_dev_engine(
        tiny_model_dir,
        log_dir=log_dir,
        name="openai-dev-engine",
        api_key="stub-key",
        extra_args=["--served-model-name", "tiny-judge", "--record-requests", str(log_dir / "engine-requests.jsonl")],
    )
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def stub(log_dir: Path) -> Iterator[ManagedProcess]:
    with start_openai_stub(log_dir, log_dir / "stub-calls.jsonl") as mp:
        yield mp


def chat_calls(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x.get("body", x) for x in lines if x.get("path", "/v1/chat/completions") == "/v1/chat/completions"]


def test_dev_engine_chat_endpoint_with_n_and_regex(dev_endpoint, key_file, log_dir):
    judge = start_openai_judge(
        log_dir,
        "judge-openai-dev",
        *("--base-url", dev_endpoint.url + "/v1", "--model", "tiny-judge", "--api-key-file", str(key_file)),
        *("--constrain-output", "--reasoning-max-chars", "4", "--max-new-tokens", "64", "--m", "3"),
    )
    try:
        before = len(chat_calls(log_dir / "engine-requests.jsonl"))
        r = httpx.post(judge.url + "/v1/judge", json={**ITEM, "tasks": ["prm"], "policy": "fixed"}, timeout=120)
        assert r.status_code == 200, r.text
        prm = r.json()["prm"]
        calls = chat_calls(log_dir / "engine-requests.jsonl")[before:]
        assert len(calls) == 1 and calls[0]["n"] == 3 and calls[0]["model"] == "tiny-judge"
        assert "\\boxed" in calls[0]["regex"] and calls[0]["messages"][0]["role"] == "system"
        assert prm["status"] in ("ok", "tie") and len(prm["votes"]) == 3 and None not in prm["votes"]
        assert prm["engine_calls"] == 1 and prm["prompt_tokens"] > 0 and prm["completion_tokens"] > 0
        ready = httpx.get(judge.url + "/ready").json()
        assert ready["backend"] == "openai" and ready["engine_url"] == dev_endpoint.url + "/v1"
    finally:
        judge.stop()


def test_stub_without_n_or_constraints_gets_concurrent_calls_and_reasks(stub, key_file, log_dir):
    judge = start_openai_judge(
        log_dir,
        "judge-openai-stub",
        *("--base-url", stub.url, "--model", "stub-judge", "--api-key-file", str(key_file)),
        *("--constrain-output", "--m", "3"),
    )
    try:
        r = httpx.post(judge.url + "/v1/judge", json={**ITEM, "tasks": ["prm", "hint"], "policy": "fixed"}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["prm"]["score"], body["prm"]["status"], body["prm"]["votes"]) == (1, "ok", [1, 1, 1])
        assert body["hint"]["accepted"] and body["hint"]["hint"].startswith("Check which folder")
        calls = chat_calls(stub.extra["calls"])
        refused = [c for c in calls if "regex" in c]
        assert refused and all(c.get("n") == 3 for c in refused)  # the first try of a task, refused (400)
        served = [c for c in calls if "regex" not in c]
        reasks = [c for c in served if c["messages"][-2]["role"] == "assistant"]
        assert len(reasks) == 6 and all("n" not in c for c in reasks)  # one re-ask per unparseable vote
        for task in ("prm", "hint"):
            # 3 answers (one n=3 request answered with 1 choice, then 2 concurrent n=1 requests) + 3 re-asks;
            # usage is the stub's: 100 prompt (40 cached), 10 completion tokens per request
            assert body[task]["engine_calls"] == 6
            assert (body[task]["prompt_tokens"], body[task]["cached_tokens"]) == (600, 240)
            assert body[task]["completion_tokens"] == 60
        assert body["usage"]["engine_calls"] == 12
        # capabilities are remembered: a second request sends no constraint and asks n=1 directly
        before = len(calls)
        assert httpx.post(judge.url + "/v1/judge", json={**ITEM, "tasks": ["prm"]}, timeout=120).status_code == 200
        later = chat_calls(stub.extra["calls"])[before:]
        assert later and all("regex" not in c and "n" not in c for c in later)
    finally:
        judge.stop()


def test_unreachable_endpoint_is_judge_failed(log_dir, key_file):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    args = ["--base-url", dead, "--model", "x", "--api-key-file", str(key_file)]
    args += ["--engine-max-attempts", "2", "--request-deadline-s", "3"]
    # Ready on /health only: /ready is 503 while the endpoint is down, which is what this test checks.
    judge = start_judge(log_dir, "judge-openai-dead", backend="openai", args=args, ready_path="/health")
    try:
        assert httpx.get(judge.url + "/ready").status_code == 503
        r = httpx.post(judge.url + "/v1/judge", json={**ITEM, "tasks": ["prm"]}, timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["prm"]["status"], r.json()["prm"]["score"]) == ("judge_failed", None)
    finally:
        judge.stop()


@pytest.mark.unit
def test_settings_and_endpoint(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from judge_server.app import endpoint
    from judge_server.settings import JudgeSettings

    with pytest.raises(ValidationError, match="base_url and model"):
        JudgeSettings(backend="openai", base_url="http://x/v1")
    key = tmp_path / "k"
    key.write_text("  sk-file \n")
    s = JudgeSettings(backend="openai", base_url="https://api.example.com/v1/", model="m", api_key_file=str(key))
    assert endpoint(s) == ("https://api.example.com", "sk-file")
    s = JudgeSettings(backend="openai", base_url="http://h:8000", model="m", engine_api_key="sk-env")
    assert endpoint(s) == ("http://h:8000", "sk-env")


@pytest.mark.unit
def test_request_body_per_constraint_form() -> None:
    from judge_server.judge import ALLOWED
    from judge_server.openai_backend import OpenAIVotes

    def body(constraint: str, n: int = 3) -> dict:
        votes = OpenAIVotes(
            None,  # type: ignore[arg-type]  # body() never calls the client
            model="m",
            temperature=0.6,
            top_p=1.0,
            max_tokens=64,
            constraint=constraint,
            seed=7,
            allowed=ALLOWED,
        )
        return votes.body([{"role": "user", "content": "q"}], n, 2, r"\\boxed\{(1|0|-1)\}")

    assert body("auto")["regex"] and body("auto")["n"] == 3 and body("auto")["seed"] == 9
    assert body("structured_outputs")["structured_outputs"] == {"regex": r"\\boxed\{(1|0|-1)\}"}
    assert "guided_regex" in body("guided_regex") and "regex" not in body("none")
    assert "n" not in body("none", n=1)
