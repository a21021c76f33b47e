"""End-to-end: typed forced tool calls and the OpenAI fields agents send, with the official ``openai`` client
against the real policy server -> sglang-router -> dev engine (constrained decoding by xgrammar).

Contract (CONTRACTS.md "Forced tool calls", "OpenAI fields"): a forced call's arguments validate against
the tool's JSON schema (checked with ``jsonschema`` for 20 seeds on a nested schema); a forced call cut by
max_tokens is ``finish_reason: length`` with no content and no tool_calls (streaming too); an
unconstrainable schema and every unknown field are 400s naming them; logprobs (top-k too, streaming too)
equal the recorded rollout log-probs; response_format json_object/json_schema is constrained; logit_bias
reaches the engine; reasoning_effort is validated and ``none`` renders thinking off; the response's
``metadata`` is the client's, Hindsight's values are headers and the ``hindsight`` field.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from policy_server.store import Store
from tests.testkit.servers import client, openai_client, policy_data_dir, start_policy

pytestmark = pytest.mark.e2e

# Array of objects, nullable integer, enum, boolean, nested object. Strings are bounded because the tiny
# test model is random: unbounded, it rarely closes a string within any sane max_tokens.
NESTED = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            },
        },
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "mode": {"type": "string", "enum": ["fast", "safe", "cheap"]},
        "urgent": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
    },
    "required": ["items", "limit", "mode", "urgent", "where"],
}
TOOLS = [
    {"type": "function", "function": {"name": "order", "description": "place an order", "parameters": NESTED}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
FORCE_ORDER = {"type": "function", "function": {"name": "order"}}
MSGS = [{"role": "user", "content": "order two widgets"}]


data_dir = policy_data_dir


def oai(policy) -> openai.OpenAI:
    return openai_client(policy.url, timeout_s=120)


def test_forced_nested_schema_call_validates_for_20_seeds(policy):
    c = oai(policy)
    for seed in range(20):
        sid = f"typed-{seed}"
        r = c.chat.completions.create(
            model="m",
            messages=MSGS,
            tools=TOOLS,
            tool_choice=FORCE_ORDER,
            seed=seed,
            temperature=1.0,
            # JSON numbers are unbounded: the random tiny model writes 90-digit integers and floats, so a whole
            # call takes up to ~500 tokens (seed 13: 489); the bound is the test's, not the grammar's.
            max_tokens=1000,
            extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        [call] = choice.message.tool_calls
        assert call.function.name == "order"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, NESTED)  # typed: integers, arrays, nulls, enums are not strings
        assert choice.message.content in (None, "")
        turn = Store(data_dir(policy)).get_turn(sid, 0)
        assert turn.constrained is True


def test_required_picks_one_of_the_tools_typed(policy):
    r = oai(policy).chat.completions.create(
        model="m", messages=MSGS, tools=TOOLS, tool_choice="required", seed=5, max_tokens=400
    )
    [call] = r.choices[0].message.tool_calls
    schema = NESTED if call.function.name == "order" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_truncated_forced_call_leaks_no_markup(policy):
    c = oai(policy)
    r = c.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=TOOLS,
        tool_choice=FORCE_ORDER,
        max_tokens=6,
        extra_headers={"X-Session-Id": "cut", "X-Session-Done": "1"},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content is None
    assert Store(data_dir(policy)).get_turn("cut", 0).constrained is True
    stream = c.chat.completions.create(
        model="m", messages=MSGS, tools=TOOLS, tool_choice=FORCE_ORDER, max_tokens=6, stream=True
    )
    chunks = [ch for ch in stream if ch.choices]
    assert not any(ch.choices[0].delta.content for ch in chunks)
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({"type": "object", "properties": {"x": {"type": "tuple"}}}, "cannot be constrained"),
        ({"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}}, "outside the schema"),
        ({"type": "array"}, "type object"),
    ],
)
def test_unconstrainable_schema_is_400(policy, parameters, fragment):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": tools, "tool_choice": "required"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == "tools[0].function.parameters"


def test_unknown_fields_are_400_naming_them(policy):
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "top_k": 3, "functions": []})
        assert r.status_code == 400
        assert "functions, top_k" in r.json()["error"]["message"]
        for body, param in (
            ({"reasoning_effort": "bogus"}, "reasoning_effort"),
            ({"top_logprobs": 3}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"logit_bias": {"abc": 1}}, "logit_bias"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"response_format": {"type": "yaml"}}, "response_format.type"),
            ({"metadata": {"k": 1}}, "metadata.k"),
            (
                {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
                "response_format",
            ),
        ):
            r = c.post("/v1/chat/completions", json={"messages": MSGS, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())


def test_logprobs_and_top_logprobs_equal_the_recorded_rollout(policy):
    c = oai(policy)
    r = c.chat.completions.create(
        model="m",
        messages=MSGS,
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
        seed=1,
        extra_headers={"X-Session-Id": "lp", "X-Session-Done": "1"},
    )
    entries = r.choices[0].logprobs.content
    turn = Store(data_dir(policy)).get_turn("lp", 0)
    assert len(entries) == r.usage.completion_tokens == len(turn.response_ids)
    assert [e.logprob for e in entries] == pytest.approx(turn.rollout_logprobs, abs=1e-6)
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # rank 1 is at least as likely as the sample
        assert bytes(e.bytes).decode() == e.token
    # streaming: the entries of all chunks together are the whole response, once each
    stream = c.chat.completions.create(
        model="m",
        messages=MSGS,
        max_tokens=10,
        logprobs=True,
        seed=2,
        stream=True,
        extra_headers={"X-Session-Id": "lp-s", "X-Session-Done": "1"},
    )
    got = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    turn = Store(data_dir(policy)).get_turn("lp-s", 0)
    assert [e.logprob for e in got] == pytest.approx(turn.rollout_logprobs, abs=1e-6)
    assert all(e.top_logprobs == [] for e in got)
    plain = c.chat.completions.create(model="m", messages=MSGS, max_tokens=3)
    assert plain.choices[0].logprobs is None


class Verdict(pydantic.BaseModel):
    ok: bool
    score: int
    level: Literal["low", "high"]


def test_response_format_json_object_and_sdk_parse(policy):
    c = oai(policy)
    r = c.chat.completions.create(
        model="m",
        messages=MSGS,
        max_tokens=200,
        seed=3,
        response_format={"type": "json_object"},
        extra_headers={"X-Session-Id": "jo", "X-Session-Done": "1"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.lstrip().startswith("{")
    assert Store(data_dir(policy)).get_turn("jo", 0).constrained is True
    parsed = c.chat.completions.parse(model="m", messages=MSGS, max_tokens=200, seed=4, response_format=Verdict)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)


def test_logit_bias_reaches_a_direct_engine_and_is_400_behind_the_router(policy, engine, tiny_model_dir, tmp_path):
    body = {"messages": MSGS, "max_tokens": 5, "logit_bias": {"65": 100}}
    with client(policy.url) as c:  # this policy server talks to the router, which would drop the field
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    direct = start_policy(tiny_model_dir, engine.url, tmp_path / "data", tmp_path, name="policy-direct")
    try:
        with client(direct.url) as c:
            r = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "bias", "X-Session-Done": "1"})
            bad = c.post("/v1/chat/completions", json={**body, "logit_bias": {"99999999": 1}})
        assert r.status_code == 200, r.text
        assert Store(tmp_path / "data").get_turn("bias", 0).response_ids == [65] * 5
        assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    finally:
        direct.stop()


def test_reasoning_effort_none_renders_thinking_off(policy, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with client(policy.url) as c:
        for sid, effort in (("re-none", "none"), ("re-high", "high")):
            r = c.post(
                "/v1/chat/completions",
                json={"messages": MSGS, "max_tokens": 2, "reasoning_effort": effort},
                headers={"X-Session-Id": sid, "X-Session-Done": "1"},
            )
            assert r.status_code == 200, r.text
    st = Store(data_dir(policy))
    off, on = (tok.decode(st.get_turn(s, 0).prompt_ids) for s in ("re-none", "re-high"))
    assert off.rstrip().endswith("</think>") and "<think>" not in on


def test_metadata_is_the_clients_and_hindsight_values_are_headers(policy):
    with client(policy.url) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": MSGS, "max_tokens": 2, "metadata": {"run": "a1"}, "user": "u1", "store": False},
            headers={"X-Session-Id": "meta"},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["metadata"] == {"run": "a1"}
        assert body["hindsight"] == {"weight_version": "v0", "session_id": "meta"}
        assert r.headers["x-hindsight-weight-version"] == "v0" and r.headers["x-hindsight-session-id"] == "meta"
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
        # Header-less: no metadata echoed; the session it got (inferred, its own) is the header's, never "meta".
        assert "metadata" not in r.json() and r.headers.get("x-hindsight-session-id") != "meta"
