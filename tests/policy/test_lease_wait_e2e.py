"""``GET /v1/samples/lease?max=N&min=M&wait_s=S`` over HTTP: policy server -> dev engine, judged by the real
judge service (rules backend: "thanks" scores +1), all on loopback ports.

Contract (policy_server.api.lease): always 200 for valid parameters; an empty queue answers after ``wait_s`` with
no samples; ``min`` holds the answer until that many are ready; a sample that becomes ready wakes a waiting
lease (measured here from the chat answer that made it judgeable); concurrent leasers never share a sample."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import admin, client, judged_policy_stack, stats
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e
U = [{"role": "user", "content": "list the files"}]
# Scheduling delay a loaded 2-core machine may add to an HTTP round trip on top of a wait; the wait's lower
# bound is exact (the server must not answer early), the upper one only says it did not hang.
SLACK_S = 3.0


@pytest.fixture(scope="module")
def judged_policy(tiny_model_dir, engine, tmp_path_factory) -> Iterator[ManagedProcess]:
    with judged_policy_stack(tiny_model_dir, engine.url, tmp_path_factory.mktemp("lease-policy")) as (pol, judge):
        yield pol
    for mp in (pol, judge):
        assert " 500 " not in mp.log_path.read_text(errors="replace")


def _chat(url: str, sid: str, messages: list[dict]) -> dict:
    with client(url) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, headers={"X-Session-Id": sid})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _first_turn(url: str, sid: str) -> list[dict]:
    """Turn 0 of a session (awaiting its next state); returns the history for turn 1."""
    a = _chat(url, sid, U)
    return U + [{"role": "assistant", "content": a["content"]}, {"role": "user", "content": "thanks, that worked"}]


def _lease(url: str, **params) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    with admin(url) as a:
        r = a.get("/v1/samples/lease", params=params)
    return r.status_code, r.json(), time.monotonic() - t0


def _ack(url: str, lease_id: str) -> None:
    with admin(url) as a:
        assert a.post("/v1/samples/ack", json={"lease_id": lease_id}).status_code == 200


def _wait_ready(url: str, n: int, timeout_s: float = 30.0) -> None:
    wait_until(lambda: stats(url)["samples"]["ready"] >= n, timeout_s=timeout_s, message=lambda: stats(url))


class _Leaser(threading.Thread):
    def __init__(self, url: str, **params):
        super().__init__(daemon=True)
        self.url, self.params = url, params
        self.sent = self.done = 0.0
        self.result: tuple[int, dict, float] | None = None

    def run(self) -> None:
        self.sent = time.monotonic()
        self.result = _lease(self.url, **self.params)
        self.done = time.monotonic()


def test_empty_queue_answers_200_after_wait_s(judged_policy):
    code, body, elapsed = _lease(judged_policy.url, max=64, wait_s=2)
    assert code == 200, body
    assert body["lease_id"] is None and body["samples"] == [] and body["prm_metrics"] == {}
    assert 1.5 <= elapsed <= 2.0 + SLACK_S


@pytest.mark.parametrize(
    "params", [{"max": 0}, {"max": 4, "min": 5}, {"min": 0}, {"wait_s": -1}, {"wait_s": 1e9}, {"max": "many"}]
)
def test_bad_parameters_are_400(judged_policy, params):
    code, body, _ = _lease(judged_policy.url, **params)
    assert code in (400, 422) and "error" in body


def test_a_ready_sample_wakes_a_waiting_lease(judged_policy):
    url = judged_policy.url
    history = _first_turn(url, "wake")
    leaser = _Leaser(url, max=8, wait_s=30)
    leaser.start()
    t_chat0 = time.monotonic()
    _chat(url, "wake", history)  # pairs turn 0 -> judged -> ready
    t_chat1 = time.monotonic()
    leaser.join(10)
    code, body, _ = leaser.result
    assert code == 200 and [s["turn_index"] for s in body["samples"]] == [0]
    assert leaser.sent < t_chat0  # the lease was waiting before the sample existed
    latency_s = leaser.done - t_chat1
    print(f"lease returned {latency_s * 1000:.0f} ms after the chat answer that made its sample judgeable")
    assert latency_s < 10.0  # generous for a loaded machine, still a third of wait_s (30 s)
    _ack(url, body["lease_id"])


def test_min_holds_until_enough_samples_are_ready(judged_policy):
    url = judged_policy.url
    h1, h2, h3 = (_first_turn(url, f"min-{i}") for i in range(3))
    _chat(url, "min-0", h1)
    _wait_ready(url, 1)
    # one ready, two needed: the answer comes when the second one is ready, well before wait_s
    leaser = _Leaser(url, max=8, min=2, wait_s=30)
    leaser.start()
    _chat(url, "min-1", h2)
    leaser.join(10)
    code, body, elapsed = leaser.result
    assert code == 200 and len(body["samples"]) == 2 and elapsed < 10
    _ack(url, body["lease_id"])
    # one ready, three needed, none coming: at wait_s with the one there is
    _chat(url, "min-2", h3)
    _wait_ready(url, 1)
    code, body, elapsed = _lease(url, max=8, min=3, wait_s=1)
    assert code == 200 and len(body["samples"]) == 1 and 0.9 <= elapsed <= 1.0 + SLACK_S
    _ack(url, body["lease_id"])


def test_concurrent_leasers_get_disjoint_samples(judged_policy):
    url = judged_policy.url
    histories = [_first_turn(url, f"pair-{i}") for i in range(2)]
    leasers = [_Leaser(url, max=1, wait_s=30) for _ in range(2)]
    for lz in leasers:
        lz.start()
    for i, h in enumerate(histories):
        _chat(url, f"pair-{i}", h)
    for lz in leasers:
        lz.join(15)
    got = [lz.result[1]["samples"] for lz in leasers]
    assert all(lz.result[0] == 200 for lz in leasers) and [len(g) for g in got] == [1, 1]
    assert got[0][0]["sample_id"] != got[1][0]["sample_id"]
    for lz in leasers:
        _ack(url, lz.result[1]["lease_id"])
