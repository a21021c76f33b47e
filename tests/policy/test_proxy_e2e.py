"""End-to-end: official ``openai`` client -> policy server -> real sglang-router -> dev engine.

Covers plain, streaming and tool-call round trips; token exactness of recorded turns (ids and
log-probs equal the engine's own sample, and a torch recomputation with the tiny model matches to
1e-4); next-state pairing over HTTP; the bad-input table; engine down -> 503 in bounded time.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from policy_server.store import Store
from tests.numerics import forward_terms, reorder_atol
from tests.testkit.servers import (
    WEATHER_TOOLS,
    admin,
    client,
    openai_client,
    policy_data_dir,
    samples_of,
    start_policy,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

TOOLS = WEATHER_TOOLS


data_dir = policy_data_dir


@pytest.fixture(scope="module")
def session_idle_timeout_s() -> float:
    """Short, so the idle end can be waited for; long enough that one test's back-to-back requests never idle out."""
    return 5.0


def oai(policy) -> openai.OpenAI:
    return openai_client(policy.url)


def test_openai_plain_and_models(policy):
    c = oai(policy)
    r = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        extra_headers={"X-Session-Id": "plain"},
    )
    assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
    assert [m.id for m in c.models.list().data] == ["hindsight-policy", "m"]  # the served name, the test alias


def test_openai_streaming_real_chunks(policy):
    c = oai(policy)
    stream = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "stream-1", "X-Session-Done": "true"},
    )
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant"
    text_chunks = [d.content for d in deltas if d.content]
    assert len(text_chunks) >= 2, "tokens must arrive in several chunks, not one faked chunk"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    # the recorded turn holds exactly the streamed tokens
    st = Store(data_dir(policy))
    turn = st.get_turn("stream-1", 0)
    assert turn is not None and len(turn.response_ids) == chunks[-1].usage.completion_tokens
    assert len(turn.rollout_logprobs) == len(turn.response_ids)
    assert turn.pairing == "session_end"


def test_openai_tool_call_round_trip(policy):
    c = oai(policy)
    sid = {"X-Session-Id": "tools-1"}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r1 = c.chat.completions.create(
        model="m",
        messages=msgs,
        tools=TOOLS,
        max_tokens=64,
        extra_headers=sid,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = r1.choices[0].message.tool_calls[0]
    assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    msgs += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
    ]
    r2 = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=8, extra_headers=sid)
    assert r2.choices[0].message.tool_calls is None
    # streaming a forced call gives tool_calls deltas the client can assemble
    s = c.chat.completions.create(
        model="m",
        messages=msgs[:1],
        tools=TOOLS,
        max_tokens=64,
        stream=True,
        tool_choice="required",
        extra_headers={"X-Turn-Type": "side"},
    )
    calls = [tc for ch in s if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather" and '"city"' in calls[0].function.arguments
    st = Store(data_dir(policy))
    first = st.get_turn("tools-1", 0)
    assert first.pairing == "paired" and first.next_state == [
        {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"}
    ]


def test_token_exact_against_engine_and_torch(policy, engine, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    h = {"X-Session-Id": "exact", "X-Session-Done": "1"}
    body = {
        "messages": [{"role": "user", "content": "write python code"}],
        "max_tokens": 16,
        "seed": 11,
        "temperature": 1.0,
    }
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", json=body, headers=h)
    assert r.status_code == 200, r.text
    turn = Store(data_dir(policy)).get_turn("exact", 0)
    ids, lps = turn.response_ids, turn.rollout_logprobs
    assert len(ids) == len(lps) == r.json()["usage"]["completion_tokens"]
    # the engine itself, same prompt ids and seed: the same sample, the same log-probs
    direct = httpx.post(
        engine.url + "/generate",
        json={
            "input_ids": turn.prompt_ids,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 11},
        },
        trust_env=False,
        timeout=60,
    ).json()
    assert direct["output_ids"] == ids
    assert [e[0] for e in direct["meta_info"]["output_token_logprobs"]] == pytest.approx(lps, abs=1e-6)
    if direct["meta_info"]["finish_reason"]["type"] == "stop":
        assert ids[-1] == direct["meta_info"]["finish_reason"]["matched"]  # stop token kept
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    full = torch.tensor([turn.prompt_ids + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0, :-1].float(), dim=-1)
    p = len(turn.prompt_ids)
    recomputed = logp[p - 1 :, :].gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    # One full forward pass vs the engine's cached decode steps: other reductions over the same float32 weights.
    atol = reorder_atol(forward_terms(model.config, full.shape[1]), max(abs(x) for x in lps))
    assert recomputed == pytest.approx(lps, abs=atol)


def _chat(c: httpx.Client, messages, sid, turn_type="main", done=False, max_tokens=6):
    h = {"X-Session-Id": sid, "X-Turn-Type": turn_type}
    if done:
        h["X-Session-Done"] = "yes"
    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens}, headers=h)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_pairing_user_reply_side_turns_rewrite_and_idle(policy):
    st = Store(data_dir(policy))
    with client(policy.url) as c:
        m = [{"role": "user", "content": "first question"}]
        a = _chat(c, m, "pair")
        _chat(c, [{"role": "user", "content": "heartbeat"}], "pair", turn_type="side")  # not recorded, no pairing
        m += [{"role": "assistant", "content": a["content"]}, {"role": "user", "content": "thanks, that worked"}]
        a2 = _chat(c, m, "pair")
        t0 = st.get_turn("pair", 0)
        assert t0.pairing == "paired" and t0.next_state == [{"role": "user", "content": "thanks, that worked"}]
        assert st.get_turn("pair", 1).pairing == "awaiting" and st.get_turn("pair", 2) is None
        # rewritten history under the same header, the awaiting reply not in it: a different conversation of that
        # key, so a new session of its family (policy_server.serving.identity) instead of rejecting the awaiting turn
        # as a mismatch (a rewrite that still ends with the recorded reply and new messages is a compaction, which
        # pairs that reply: tests/policy/test_compaction_pairing.py)
        rewritten = [{"role": "user", "content": "a different first question"}] + m[1:]
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": rewritten
                + [{"role": "assistant", "content": a2["content"] + " (edited)"}, {"role": "user", "content": "hm"}],
                "max_tokens": 6,
            },
            headers={"X-Session-Id": "pair"},
        )
        assert r.status_code == 200, r.text
        split = r.headers["x-hindsight-session-id"]
        assert split.startswith("pair~") and st.get_turn(split, 0).pairing == "awaiting"
        assert st.get_turn("pair", 2) is None
        # the idle timeout (5 s in this module) ends both sessions: their last turns get no next state, none is lost
        for sid, idx in (("pair", 1), (split, 0)):
            turn = wait_until(
                lambda sid=sid, idx=idx: (t := st.get_turn(sid, idx)) is not None and t.pairing != "awaiting" and t,
                timeout_s=30,
                interval_s=0.2,
            )
            assert turn.pairing == "session_end" and turn.session_done and turn.next_state is None
        rows = {s.turn_index: s for s in samples_of(st, "pair")}
        assert rows[0].status == "pending_judge"  # no judge configured: stays pending, never dropped
        stats = admin(policy.url).get("/v1/samples/stats").json()
        assert stats["turns_by_session_rule"]["header:diverged"] >= 1


BIG = "x" * 70_000


@pytest.mark.parametrize(
    "body,headers,status,needle",
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "role 'wizard'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r", "tool_call_id": "c"}]},
            {},
            400,
            "does not match",
        ),
        ({"messages": [{"role": "user", "content": "x"}]}, {"X-Turn-Type": "primary"}, 400, "X-Turn-Type"),
        ({"messages": [{"role": "user", "content": "x"}]}, {"X-Session-Done": "maybe"}, 400, "X-Session-Done"),
        ({"messages": [{"role": "user", "content": "x"}], "turn_type": "bogus"}, {}, 400, "X-Turn-Type"),
        ({"messages": []}, {}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, {}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, {}, 400, "n=1"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, {}, 400, "tool_choice"),
        ({"messages": [{"role": "user", "content": BIG}]}, {}, 413, "exceeds"),
        ("not json", {}, 400, "not valid JSON"),
        ({"messages": [{"role": "user", "content": "x"}]}, {"Authorization": "Bearer wrong"}, 401, "invalid api key"),
    ],
)
def test_bad_input_table(policy, body, headers, status, needle):
    with client(policy.url) as c:
        kw = {"content": body} if isinstance(body, str) else {"json": body}
        r = c.post("/v1/chat/completions", headers={"X-Session-Id": "bad", **headers}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and err["code"] == status


def test_admin_needs_admin_key(policy):
    with client(policy.url) as c:
        assert c.get("/v1/samples/stats").status_code == 401
    with admin(policy.url) as a:
        assert a.get("/v1/samples/lease", params={"max": 0}).status_code == 400
        assert a.post("/v1/samples/ack", json={"lease_id": "nope"}).status_code == 404
        assert a.post("/admin/mode", json={"mode": "bogus"}).status_code == 400
        assert a.get("/admin/mode").json()["mode"] == "rl"


def test_engine_down_is_503_not_a_hang(tiny_model_dir, tmp_path):
    from tests.testkit.procs import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    pol = start_policy(tiny_model_dir, dead, tmp_path / "data", tmp_path, name="policy-dead")
    try:
        with client(pol.url) as c:
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
            assert r.status_code == 503
            assert time.monotonic() - t0 < 30
            assert c.get("/ready").status_code == 503
    finally:
        pol.stop()
