"""Sessions without headers (policy_server.serving.session_inference): the longest recorded transcript a request
extends wins, ties go to the oldest awaiting turn, a retry or a fresh conversation starts a session; and
over HTTP (on by default): header-less turns are recorded, paired and counted.
"""

from __future__ import annotations

import httpx
import pytest

from engine.records import Turn, TurnRecord
from policy_server.serving.session_inference import INFERRED_PREFIX, choose_session
from policy_server.store import Store
from tests.testkit.servers import CLIENT_KEY, admin, client, start_policy
from tests.waiting import async_wait_until


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def awaiting(sid: str, messages: list[dict], reply: str) -> Turn:
    return Turn(
        session_id=sid, turn_index=0, created_at=0.0, messages=messages, response={"content": reply, "tool_calls": None}
    )


@pytest.mark.unit
def test_choose_session_longest_extension_wins():
    short = awaiting("s-short", [U("hi")], "hello")
    long = awaiting("s-long", [U("hi"), A("hello"), U("more")], "sure")
    n = [U("hi"), A("hello"), U("more"), A("sure"), U("thanks")]
    assert choose_session([short, long], n) == ("s-long", False)
    # the short one is extended by a request that continues it instead
    assert choose_session([short, long], [U("hi"), A("hello"), U("other")]) == ("s-short", False)


@pytest.mark.unit
@pytest.mark.parametrize(
    "messages",
    [
        [U("hi")],  # a retry of the awaiting request (or a fresh conversation with the same opening)
        [U("hi"), A("something else"), U("x")],  # a different reply
        [U("bye"), A("hello"), U("x")],  # a different history
        [U("hi"), A("hello")],  # no feedback after the reply
    ],
)
def test_choose_session_no_extension_starts_a_session(messages):
    assert choose_session([awaiting("s", [U("hi")], "hello")], messages) == (None, False)


@pytest.mark.unit
def test_choose_session_tie_goes_to_the_oldest():
    turns = [awaiting("old", [U("task")], "same"), awaiting("new", [U("task")], "same")]
    assert choose_session(turns, [U("task"), A("same"), U("go on")]) == ("old", True)


@pytest.mark.e2e
def test_header_less_sessions_are_inferred_paired_and_counted(engine, tiny_model_dir, tmp_path):
    pol = start_policy(
        tiny_model_dir, engine.url, tmp_path / "data", tmp_path, name="policy-infer", extra=["--infer-sessions"]
    )
    try:
        with client(pol.url) as c:

            def ask(messages: list[dict]) -> tuple[str, str]:
                r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "seed": 1})
                assert r.status_code == 200, r.text
                return r.headers["x-hindsight-session-id"], r.json()["choices"][0]["message"]["content"]

            first = [U("plan my trip")]
            sid, reply = ask(first)
            assert sid.startswith(INFERRED_PREFIX)
            sid2, reply2 = ask([*first, A(reply), U("to Paris")])
            assert sid2 == sid
            sid3, _ = ask(first)  # the same opening again: a new conversation, not a continuation
            assert sid3 != sid
            ask([*first, A(reply), U("to Paris"), A(reply2), U("in May")])
            metrics = c.get("/metrics").text
        with admin(pol.url) as a:
            stats = a.get("/v1/samples/stats").json()
        st = Store(tmp_path / "data")
        t0, t1 = st.get_turn(sid, 0), st.get_turn(sid, 1)
        assert t0.pairing == "paired" and t0.next_state == [{"role": "user", "content": "to Paris"}]
        assert t1.pairing == "paired" and t1.next_state == [{"role": "user", "content": "in May"}]
        assert st.get_turn(sid3, 0).pairing == "awaiting"
        assert stats["inferred_sessions"] == 2
        assert 'hindsight_policy_inferred_sessions_total{outcome="continued"} 2.0' in metrics
        assert 'hindsight_policy_inferred_sessions_total{outcome="started"} 2.0' in metrics
    finally:
        pol.stop()


@pytest.mark.e2e
def test_inference_is_on_by_default(policy):
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(
            policy.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
            json={"messages": [U("recorded without a header")], "max_tokens": 2},
        )
    assert r.status_code == 200
    assert r.json()["hindsight"]["session_id"].startswith(INFERRED_PREFIX)
    assert r.headers["x-hindsight-session-id"] == r.json()["hindsight"]["session_id"]


@pytest.mark.unit
async def test_a_session_being_continued_is_not_claimed_twice(tmp_path):
    """The pairing is written with the turn record (one commit), so between a claim and that record the
    awaiting turn is still in the store: a second identical header-less request must start a session
    rather than claim the same turn; once the first settles, nothing is left to claim."""
    from policy_server.metrics import Metrics
    from policy_server.serving.session_inference import SessionInferrer
    from policy_server.serving.sessions import SessionTracker

    store = Store(tmp_path / "data")
    try:
        rec = {
            "messages": [U("hi")],
            "tools": None,
            "prompt_ids": [1, 2],
            "response_ids": [3, 4],
            "rollout_logprobs": [-0.1, -0.2],
            "response": {"content": "hello", "tool_calls": None},
            "weight_version": "v0",
            "weight_versions": ["v0"],
            "sampling_params": {},
        }
        store.record_turn("s1", TurnRecord.model_validate(rec), session_done=False)
        tracker = SessionTracker(store, idle_timeout_s=60)
        inferrer = SessionInferrer(store, tracker, Metrics())
        follow_up = [U("hi"), A("hello"), U("thanks")]
        sid, arrival = await inferrer.claim(follow_up, done=False)
        assert sid == "s1" and arrival is not None and arrival.resolution is not None
        retry_sid, retry_arrival = await inferrer.claim(follow_up, done=False)
        assert retry_sid.startswith(INFERRED_PREFIX) and retry_arrival is None
        tracker.settle_later(arrival)  # the first request failed before recording: its pairing is written alone
        await async_wait_until(lambda: not tracker.in_flight("s1"), timeout_s=2, interval_s=0.01)
        assert store.awaiting_open_turns() == []
    finally:
        store.close()
