"""Judge operations, end to end: hindsight-judge (real process, JSON logs) -> a CPU dev engine.

Contract (engine/observability.py): every response echoes (or creates) ``X-Request-ID``;
the judge's log lines for that request carry it, and so do the engine's, because the judge forwards it on
its engine calls; /metrics counts requests by route template, method and status; the resolved settings
are logged at start as JSON with the judge's and the engine's keys masked; ``--log-json`` (here through
HINDSIGHT_JUDGE_LOG_JSON) makes every log line a JSON object, uvicorn's own lines included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import ENGINE_KEY, JUDGE_KEY, llm_judge_stack, prm_pair

pytestmark = pytest.mark.e2e

REQ = prm_pair()


@dataclass
class Ops:
    engine: ManagedProcess
    judge: ManagedProcess

    def post(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            self.judge.url + "/v1/judge",
            json=body,
            trust_env=False,
            timeout=60,
            headers={"Authorization": f"Bearer {JUDGE_KEY}", **(headers or {})},
        )

    def judge_records(self) -> list[dict[str, Any]]:
        lines = [ln for ln in self.judge.log_path.read_text().splitlines() if ln.strip()]
        return [json.loads(ln) for ln in lines]  # every line must be JSON


@pytest.fixture(scope="module")
def ops(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    env = {
        "HINDSIGHT_JUDGE_API_KEY": JUDGE_KEY,
        "HINDSIGHT_JUDGE_ENGINE_API_KEY": ENGINE_KEY,
        "HINDSIGHT_JUDGE_LOG_JSON": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    args = ["--max-new-tokens", "8", "--request-deadline-s", "20"]
    log_dir = tmp_path_factory.mktemp("judge-ops")
    with llm_judge_stack(tiny_model_dir, log_dir, engine_api_key=ENGINE_KEY, args=args, env=env) as s:
        yield Ops(s.engines[0], s.judge)


def test_request_id_echoed_logged_and_forwarded_to_the_engine(ops: Ops) -> None:
    r = ops.post(REQ, headers={"X-Request-ID": "judge-ops-1", "X-Session-Id": "sess-a"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "judge-ops-1"
    assert r.json()["usage"]["engine_calls"] == 1
    # Written before the response's last byte (engine.observability): one read after the response suffices.
    access = [x for x in ops.judge_records() if x["message"].startswith("POST /v1/judge -> 200")]
    assert [(x["request_id"], x["session_id"]) for x in access] == [("judge-ops-1", "sess-a")]
    # The engine saw the same ids on the judge's /generate call.
    assert re.search(
        r"request_id=judge-ops-1 session_id=sess-a: POST /generate -> 200", ops.engine.log_path.read_text()
    )


def test_request_id_generated_when_absent_or_invalid(ops: Ops) -> None:
    for headers in ({}, {"X-Request-ID": "x" * 200}):
        rid = ops.post(REQ, headers=headers).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert httpx.post(ops.judge.url + "/v1/judge", json=REQ, trust_env=False).status_code == 401


def test_metrics_by_route_template(ops: Ops) -> None:
    ops.post(REQ)
    assert httpx.get(ops.judge.url + "/v1/nope/123", trust_env=False).status_code == 404
    text = httpx.get(ops.judge.url + "/metrics", trust_env=False).text
    assert re.search(r'hindsight_judge_http_requests_total\{method="POST",route="/v1/judge",status="200"\} [1-9]', text)
    assert 'hindsight_judge_http_requests_total{method="POST",route="/v1/judge",status="401"}' in text
    assert 'hindsight_judge_http_requests_total{method="GET",route="<unmatched>",status="404"}' in text
    assert 'hindsight_judge_http_request_duration_seconds_bucket{le="0.5",method="POST",route="/v1/judge"' in text
    assert "/v1/nope" not in text
    assert "hindsight_judge_verdicts_total" in text  # the service's own metrics stay on the same registry


def test_startup_log_has_resolved_config_with_secrets_masked(ops: Ops) -> None:
    records = ops.judge_records()
    [cfg_line] = [x for x in records if x["message"].startswith("judge resolved config: ")]
    config = json.loads(cfg_line["message"].removeprefix("judge resolved config: "))
    assert cfg_line["config"] == config  # also a structured field of the JSON line
    assert config["api_key"] == config["engine_api_key"] == "***"
    assert config["engine_url"] == ops.engine.url and config["backend"] == "llm"
    assert config["max_new_tokens"] == 8 and config["tokenizer_path"]  # not secrets, despite "token"
    assert any(x["logger"].startswith("uvicorn") for x in records)  # uvicorn's lines go through our handler
    assert not [x for x in records if "color_message" in x]
    log = ops.judge.log_path.read_text()
    assert JUDGE_KEY not in log and ENGINE_KEY not in log
