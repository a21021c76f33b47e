"""Dev engine operations, end to end on a real process: /metrics, X-Request-ID, the startup config log.

Contract (devkit/dev_server/metrics.py, engine/observability.py): ``GET /metrics`` is open even with an api
key and serves ``sglang:*`` counters that move by exactly the tokens/requests served (prompt tokens per
sample, output tokens, one request per sample) plus ``hindsight_dev_engine_http_*`` by route template;
every response echoes (or creates) ``X-Request-ID`` and that request's log line carries it; the resolved
settings are logged at start with both keys masked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine
from tests.testkit.servers import ADMIN_KEY
from tests.testkit.servers import ENGINE_KEY as API_KEY
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = 'model_name="tiny"'


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    mp = start_dev_engine(
        tiny_model_dir,
        log_dir=tmp_path_factory.mktemp("engine-ops"),
        api_key=API_KEY,
        extra_args=["--served-model-name", "tiny", "--admin-api-key", ADMIN_KEY],
    )
    yield mp
    mp.stop()


def scrape(engine: ManagedProcess) -> dict[str, float]:
    r = httpx.get(engine.url + "/metrics", trust_env=False, timeout=10)  # no Authorization: open, as in SGLang
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_sglang_counters_follow_served_tokens(engine: ManagedProcess) -> None:
    before = scrape(engine)
    assert before[f"sglang:num_running_reqs{{{MODEL}}}"] == 0 and before[f"sglang:num_queue_reqs{{{MODEL}}}"] == 0
    gen = httpx.post(
        engine.url + "/generate",
        headers=AUTH,
        trust_env=False,
        timeout=60,
        json={"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "n": 2}},
    ).json()
    chat = httpx.post(
        engine.url + "/v1/chat/completions",
        headers=AUTH,
        trust_env=False,
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ).json()
    after = scrape(engine)

    def delta(name: str) -> float:
        key = f"{name}{{{MODEL}}}"
        return after[key] - before.get(key, 0.0)

    assert delta("sglang:prompt_tokens_total") == 2 * 4 + chat["usage"]["prompt_tokens"]
    assert delta("sglang:generation_tokens_total") == (
        sum(g["meta_info"]["completion_tokens"] for g in gen) + chat["usage"]["completion_tokens"]
    )
    assert delta("sglang:num_requests_total") == 3
    assert delta("sglang:e2e_request_latency_seconds_count") == 2  # two prompts
    route = 'hindsight_dev_engine_http_requests_total{method="POST",route="/generate",status="200"}'
    assert after[route] - before.get(route, 0.0) == 1


def test_route_metrics_count_unauthorized_and_use_templates(engine: ManagedProcess) -> None:
    r = httpx.post(engine.url + "/generate", json={"input_ids": [1]}, trust_env=False, timeout=10)
    assert r.status_code == 401
    assert httpx.get(engine.url + "/v1/models/some-other-model", headers=AUTH, trust_env=False).status_code == 404
    after = scrape(engine)
    assert after['hindsight_dev_engine_http_requests_total{method="POST",route="/generate",status="401"}'] >= 1
    assert (
        after['hindsight_dev_engine_http_requests_total{method="GET",route="/v1/models/{model:path}",status="404"}']
        >= 1
    )
    assert not [k for k in after if "some-other-model" in k]


def test_request_id_echoed_and_logged(engine: ManagedProcess) -> None:
    r = httpx.post(
        engine.url + "/generate",
        headers={**AUTH, "X-Request-ID": "eng-ops-42"},
        trust_env=False,
        timeout=60,
        json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "eng-ops-42"
    fresh = httpx.get(engine.url + "/health", trust_env=False).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh)
    log = engine.log_path.read_text()  # access lines are written before a response's last byte
    assert re.search(r"request_id=eng-ops-42 session_id=-: POST /generate -> 200 in [\d.]+ ms", log), log[-2000:]


def test_startup_log_has_resolved_config_with_keys_masked(engine: ManagedProcess) -> None:
    log = engine.log_path.read_text()
    line = next(ln for ln in log.splitlines() if "dev engine resolved config: " in ln)
    config = json.loads(line.split("dev engine resolved config: ", 1)[1])
    assert config["api_key"] == config["admin_api_key"] == "***"
    assert config["served_model_name"] == "tiny" and config["host"] == "127.0.0.1"
    assert config["model_path"] and config["max_running_requests"] >= 1
    assert API_KEY not in log and ADMIN_KEY not in log


def test_non_streaming_generate_is_aborted_when_the_caller_hangs_up(engine: ManagedProcess) -> None:
    # ~3000 tokens take several seconds on the tiny model; a caller that leaves after 0.5 s must not keep
    # the engine busy to the last token (SGLang aborts a request whose connection closed).
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            engine.url + "/generate", headers=AUTH, trust_env=False, json=body, timeout=httpx.Timeout(10.0, read=0.5)
        )
    key = f"sglang:num_running_reqs{{{MODEL}}}"
    wait_until(
        lambda: scrape(engine)[key] == 0, timeout_s=1.5, message="the generation kept running after its caller left"
    )
    r = httpx.post(
        engine.url + "/generate",
        headers=AUTH,
        trust_env=False,
        timeout=30,
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}},
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
