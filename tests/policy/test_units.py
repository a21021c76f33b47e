"""Unit tests of the policy server's pure parts: pairing rule, store state machine (exactly-once leases),
stream splitting, request validation, settings/CLI, forced tool-call grammars."""

from __future__ import annotations

import json
import re

import pytest

from policy_server.cli import settings_from_args
from policy_server.errors import InvalidRequest
from policy_server.openai_schemas import validate_messages
from policy_server.sessions import pair_next_state
from policy_server.store import LeaseError, Store
from policy_server.streaming import StreamSplitter
from policy_server.tool_choice import forced_tool_grammar, response_format_schema

pytestmark = pytest.mark.unit

U = {"role": "user", "content": "weather in Paris?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RESP_TOOL = {"content": "", "reasoning_content": "think", "tool_calls": [CALL]}
ASSIST_TOOL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "zz", "type": "function", "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'}}]}


def test_pair_user_reply():
    p = pair_next_state([U], {"content": "Sunny."}, [U, {"role": "assistant", "content": " Sunny.\n"},
                                                    {"role": "user", "content": "thanks"}])
    assert p.kind == "paired" and p.next_state == [{"role": "user", "content": "thanks"}]


def test_pair_several_tool_results_and_dropped_system():
    new = [U, ASSIST_TOOL, {"role": "tool", "tool_call_id": "zz", "content": "18C"},
           {"role": "tool", "tool_call_id": "zz", "content": "sunny"}, {"role": "system", "content": "reminder"}]
    p = pair_next_state([U], RESP_TOOL, new)
    assert p.kind == "paired"
    assert [m["role"] for m in p.next_state] == ["tool", "tool"] and p.next_state[1]["content"] == "sunny"
    assert p.dropped == ["system"]


@pytest.mark.parametrize("new,why", [
    ([{"role": "user", "content": "other question"}, {"role": "assistant", "content": "Sunny."},
      {"role": "user", "content": "ok"}], "rewritten"),
    ([U, {"role": "assistant", "content": "Edited reply"}, {"role": "user", "content": "ok"}], "assistant"),
    ([U, {"role": "assistant", "content": "Sunny."}], "expected more"),
    ([U, {"role": "assistant", "content": "Sunny."}, {"role": "system", "content": "x"}], "no user or tool"),
])
def test_pair_mismatch(new, why):
    p = pair_next_state([U], {"content": "Sunny."}, new)
    assert p.kind == "mismatch" and p.next_state is None and why in p.note


def _record(n: int = 3) -> dict:
    return {"messages": [U], "tools": None, "prompt_ids": [1, 2], "response_ids": list(range(n)),
            "rollout_logprobs": [-0.5] * n, "response": {"content": "x"}, "weight_version": "v0",
            "weight_versions": ["v0"], "sampling_params": {}}


def _ready_sample(store: Store, sid: str) -> str:
    store.record_turn(sid, _record(), session_done=True)
    [job] = [j for j in store.pending_jobs() if j["session_id"] == sid]
    assert store.complete_judge(job["sample_id"], status="ready", reject_reason=None, included=True,
                                data={"sample_id": job["sample_id"], "session_id": sid})
    return job["sample_id"]


def test_store_turns_pairing_and_session_end(tmp_path):
    st = Store(tmp_path)
    assert st.record_turn("s", _record(), session_done=False) == 0
    assert st.awaiting_turn("s")["turn_index"] == 0
    sid = st.resolve_turn("s", 0, pairing="paired", next_state=[{"role": "user", "content": "ok"}], session_done=False)
    assert sid and st.resolve_turn("s", 0, pairing="paired", next_state=None, session_done=False) is None
    assert st.record_turn("s", _record(), session_done=True) == 1  # last turn: resolved with no next state
    assert st.get_turn("s", 1)["pairing"] == "session_end"
    assert [j["turn_index"] for j in st.pending_jobs()] == [0, 1]
    st.close()
    st2 = Store(tmp_path)  # durable across reopen
    assert [j["turn_index"] for j in st2.pending_jobs()] == [0, 1]
    assert st2.stats()["samples"]["pending_judge"] == 2


def test_store_concurrent_turns_reject_the_overtaken(tmp_path):
    st = Store(tmp_path)
    st.record_turn("s", _record(), session_done=False)
    st.record_turn("s", _record(), session_done=False)
    assert st.stats()["reject_reasons"] == {"concurrent_turns": 1}
    assert st.awaiting_turn("s")["turn_index"] == 1


def test_lease_ack_exactly_once_and_expiry(tmp_path):
    st = Store(tmp_path)
    a, b = _ready_sample(st, "a"), _ready_sample(st, "b")
    lease_id, samples = st.lease(1, lease_s=10, now=100.0)
    assert [s["sample_id"] for s in samples] == [a]
    lease2, samples2 = st.lease(10, lease_s=10, now=101.0)
    assert [s["sample_id"] for s in samples2] == [b]  # a is leased: never handed out twice
    assert st.lease(10, lease_s=10, now=102.0) is None
    assert st.ack(lease_id, now=103.0) == {"lease_id": lease_id, "acked": 1, "already_acked": False}
    assert st.ack(lease_id, now=104.0)["already_acked"] is True  # idempotent
    # lease2 expires: b comes back, the old lease can no longer be acked, a (acked) never returns
    lease3, samples3 = st.lease(10, lease_s=10, now=120.0)
    assert [s["sample_id"] for s in samples3] == [b]
    with pytest.raises(LeaseError) as e:
        st.ack(lease2, now=121.0)
    assert e.value.kind == "expired"
    with pytest.raises(LeaseError):
        st.ack("nope", now=121.5)
    st.ack(lease3, now=122.0)
    assert st.stats()["samples"]["consumed"] == 2 and st.lease(10, 10, now=500.0) is None


def test_complete_judge_rejects_bad_status(tmp_path):
    st = Store(tmp_path)
    with pytest.raises(ValueError):
        st.complete_judge("x", status="leased", reject_reason=None, included=False, data={})


def _split(chunks: list[str]) -> tuple[str, str, list]:
    sp = StreamSplitter()
    parts = [p for c in chunks for p in sp.feed(c)]
    tail, calls = sp.finish()
    parts += tail
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"), calls)


@pytest.mark.parametrize("text", [
    "<think>\nplan it\n</think>\n\nThe answer is 4.",
    "plain answer with < and <t chars",
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>only reasoning, cut by max_tokens",
    "text then <tool_call>not json</tool_call> more",
])
def test_stream_splitter_matches_full_parse(text):
    from engine.chat import parse_assistant_output

    full = parse_assistant_output(text)
    for size in (1, 3, 7, len(text)):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        reasoning, content, calls = _split(chunks)
        assert reasoning == (full.reasoning_content or "")
        assert content == full.content
        assert [c["function"] for c in calls] == [c["function"] for c in full.tool_calls]


def test_stream_splitter_never_leaks_tag_fragments():
    sp = StreamSplitter()
    out = sp.feed("<thi") + sp.feed("nk>abc</th") + sp.feed("ink>Hi <tool_") + sp.feed("call>{}")
    assert "".join(t for _, t in out) == "abcHi"


@pytest.mark.parametrize("messages,msg", [
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r", "tool_call_id": "c9"}], "does not match"),
    ([{"role": "tool", "content": "r"}], "without tool_call_id"),
    ([{"role": "user", "content": 5}], "content must be"),
    ([{"role": "user"}], "needs content"),
])
def test_validate_messages_rejects(messages, msg):
    with pytest.raises(InvalidRequest, match=msg):
        validate_messages(messages)


def test_validate_messages_accepts_tool_round_trip():
    out = validate_messages([{"role": "developer", "content": "be brief"}, U, ASSIST_TOOL,
                             {"role": "tool", "tool_call_id": "zz", "content": "18C"}])
    assert out[0]["role"] == "system" and len(out) == 4


def test_settings_from_cli_and_env(monkeypatch):
    monkeypatch.setenv("HINDSIGHT_POLICY_MODE", "combine")
    monkeypatch.setenv("HINDSIGHT_POLICY_ENGINE_WORKER_URLS", "http://a:1,http://b:2")
    s = settings_from_args(["--model-path", "m", "--engine-url", "http://r:9/", "--pause-mode", "retract",
                            "--session-idle-timeout-s", "5"])
    assert (s.mode, s.engine_url, s.engine_worker_urls, s.pause_mode, s.session_idle_timeout_s) == \
        ("combine", "http://r:9", ["http://a:1", "http://b:2"], "retract", 5.0)
    s2 = settings_from_args(["--model-path", "m", "--engine-url", "http://r:9", "--mode", "opd"])
    assert s2.mode == "opd" and s2.engine_worker_urls == ["http://a:1", "http://b:2"]
    monkeypatch.delenv("HINDSIGHT_POLICY_ENGINE_WORKER_URLS")
    assert settings_from_args(["--model-path", "m", "--engine-url", "http://r:9"]).engine_worker_urls == ["http://r:9"]
    with pytest.raises(ValueError):
        settings_from_args(["--model-path", "m", "--engine-url", "http://r", "--pause-mode", "bogus"])


def _accepts(ebnf: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(ebnf, text))


def test_forced_tool_grammar_types_arguments_by_schema():
    """The forced-call grammar admits exactly the Hermes block whose arguments satisfy the schema."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}},
                                         "unit": {"enum": ["c", "f"]}, "limit": {"type": ["integer", "null"]}},
        "required": ["city", "days", "tags", "unit", "limit"]}}}]
    g = forced_tool_grammar(tools, {"type": "function", "function": {"name": "get_weather"}})
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    ok = head + '{"city": "Paris", "days": 3, "tags": ["a", "b"], "unit": "c", "limit": null}}\n</tool_call>'
    assert _accepts(g, ok)
    assert json.loads(ok[len("<tool_call>\n"):-len("\n</tool_call>")])["arguments"]["tags"] == ["a", "b"]
    assert not _accepts(g, ok.replace('"days": 3', '"days": "3"'))  # integer, not a string
    assert not _accepts(g, ok.replace('["a", "b"]', '"a, b"'))  # array, not a string
    assert not _accepts(g, ok.replace('"unit": "c"', '"unit": "k"'))  # enum
    assert not _accepts(g, ok.replace(', "limit": null', ''))  # required
    assert not _accepts(g, ok.replace("</tool_call>", ""))  # the block is closed
    assert forced_tool_grammar(tools, "auto") is None and forced_tool_grammar(tools, None) is None
    with pytest.raises(InvalidRequest):
        forced_tool_grammar(tools, {"type": "function", "function": {"name": "nope"}})


def test_forced_tool_grammar_required_is_one_call_of_any_tool_and_empty_parameters():
    tools = [{"type": "function", "function": {"name": "a"}},
             {"type": "function", "function": {"name": "b", "parameters": {
                 "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}}}]
    g = forced_tool_grammar(tools, "required")
    assert _accepts(g, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')
    assert _accepts(g, '<tool_call>\n{"name": "b", "arguments": {"x": true}}\n</tool_call>')
    assert not _accepts(g, '<tool_call>\n{"name": "a", "arguments": {"x": true}}\n</tool_call>')
    assert not _accepts(g, '<tool_call>\n{"name": "c", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("parameters, fragment", [
    ({"type": "string"}, "type object"),
    ({"type": "object", "properties": {"x": {"type": "bogus"}}}, "cannot be constrained"),
    ({"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}, "outside the schema"),
])
def test_unconstrainable_tool_schema_is_a_400(parameters, fragment):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(InvalidRequest) as exc:
        forced_tool_grammar(tools, "required")
    assert fragment in exc.value.message and exc.value.param == "tools[0].function.parameters"


def test_response_format_schema():
    assert response_format_schema(None) is None and response_format_schema({"type": "text"}) is None
    assert json.loads(response_format_schema({"type": "json_object"})) == {"type": "object"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert json.loads(response_format_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})) \
        == schema
    for bad in ({"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "yaml"},
                {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}):
        with pytest.raises(InvalidRequest):
            response_format_schema(bad)
