"""Durability: kill -9 the policy server mid-session and restart it on the same data directory.

Nothing accepted is lost (turns, pairing state, samples), pending judge work (judge unreachable before the
crash) is resumed after the restart against the real judge service (rules backend), and leases are
honoured across restarts (a leased sample is not handed out again until its lease expires; ack is
idempotent and exactly-once)."""

from __future__ import annotations

import time

import pytest

from policy_server.store import Store
from tests.testkit.procs import free_port
from tests.testkit.servers import admin, client, samples_of, start_judge, start_policy
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LEASE_S = 20.0  # longer than a policy-server restart on a loaded 2-core machine: the lease outlives it


def _chat(url: str, messages: list[dict], sid: str) -> dict:
    with client(url) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6}, headers={"X-Session-Id": sid})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_kill9_restart_resumes_and_honours_leases(tiny_model_dir, router, tmp_path):
    data = tmp_path / "data"
    judge_port = free_port()
    judge_url = f"http://127.0.0.1:{judge_port}"
    extra = [
        "--judge-url",
        judge_url,
        "--dispatch-retry-initial-s",
        "0.2",
        "--dispatch-retry-max-s",
        "1",
        "--lease-timeout-s",
        str(LEASE_S),
    ]
    pol = start_policy(tiny_model_dir, router.url, data, tmp_path, name="policy-a", extra=extra)
    judge = None
    try:
        u1 = [{"role": "user", "content": "open the file"}]
        a1 = _chat(pol.url, u1, "d1")
        _chat(
            pol.url,
            u1 + [{"role": "assistant", "content": a1["content"]}, {"role": "user", "content": "thanks, that worked"}],
            "d1",
        )
        u2 = [{"role": "user", "content": "list the files"}]
        a2 = _chat(pol.url, u2, "d2")
        st = Store(data)
        # the judge is down: the paired turn stays pending_judge and is retried, never dropped
        wait_until(lambda: st.stats().pending_judge_retrying >= 1)
        pol.kill()  # kill -9 mid-session

        judge = start_judge(tmp_path, port=judge_port)
        pol = start_policy(tiny_model_dir, router.url, data, tmp_path, name="policy-b", extra=extra)
        # pending work resumes after the restart
        wait_until(lambda: st.stats().samples["ready"] >= 1)
        row = samples_of(st, "d1")[0]
        assert row.status == "ready" and row.sample is not None
        assert row.sample["reward"] == 1.0 and row.sample["mode"] == "rl"
        turn = st.get_turn("d1", 0)
        assert row.sample["response_ids"] == turn.response_ids
        assert row.sample["rollout_logprobs"] == turn.rollout_logprobs
        assert row.sample["prompt_ids"] == turn.prompt_ids
        # pairing state survived the crash: d2's awaiting turn pairs with the next request
        _chat(
            pol.url,
            u2 + [{"role": "assistant", "content": a2["content"]}, {"role": "user", "content": "No, that is wrong."}],
            "d2",
        )
        wait_until(lambda: {s.status for s in samples_of(st, "d2")} - {"pending_judge"} != set())
        with admin(pol.url) as a:
            lease = a.get("/v1/samples/lease", params={"max": 10, "wait_s": 5}).json()
        leased_at = time.monotonic()
        leased = {s["sample_id"] for s in lease["samples"]}
        assert row.sample_id in leased
        for s in lease["samples"]:
            assert len(s["response_ids"]) == len(s["rollout_logprobs"]) == len(s["loss_mask"])
        pol.kill()

        pol = start_policy(tiny_model_dir, router.url, data, tmp_path, name="policy-c", extra=extra)
        with admin(pol.url) as a:
            again = a.get("/v1/samples/lease", params={"max": 10}).json()
            assert time.monotonic() - leased_at < LEASE_S
            assert not leased & {s["sample_id"] for s in again["samples"]}, "a live lease is honoured"
            time.sleep(max(0.0, LEASE_S - (time.monotonic() - leased_at)) + 0.2)  # expired: unacked samples return
            back = a.get("/v1/samples/lease", params={"max": 10, "wait_s": 2}).json()
            assert leased <= {s["sample_id"] for s in back["samples"]}
            assert a.post("/v1/samples/ack", json={"lease_id": lease["lease_id"]}).status_code == 409
            r1 = a.post("/v1/samples/ack", json={"lease_id": back["lease_id"]}).json()
            r2 = a.post("/v1/samples/ack", json={"lease_id": back["lease_id"]}).json()
            assert r1["acked"] == len(back["samples"]) and r2["already_acked"]
            if again["lease_id"]:
                a.post("/v1/samples/ack", json={"lease_id": again["lease_id"]})
            assert a.get("/v1/samples/lease", params={"max": 10}).json()["samples"] == []
            stats = a.get("/v1/samples/stats").json()
        assert stats["samples"]["consumed"] >= len(leased) and stats["samples"]["leased"] == 0
        assert stats["turns"] == 4 and stats["turns_awaiting_next_state"] == 2  # nothing lost
    finally:
        pol.stop()
        if judge:
            judge.stop()
