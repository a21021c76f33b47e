"""Unit tests of the policy server's pure parts: pairing rule (the store state machine: test_store.py),
stream splitting, request validation, settings/CLI, forced tool-call grammars."""

from __future__ import annotations

import json

import pytest

from policy_server.api.chat.streaming import StreamSplitter
from policy_server.api.openai_schemas import validate_messages
from policy_server.cli import settings_from_args
from policy_server.errors import InvalidRequest
from policy_server.serving.pairing import pair_next_state
from policy_server.serving.tool_choice import forced_tool_grammar, response_format_grammar

pytestmark = pytest.mark.unit

U = {"role": "user", "content": "weather in Paris?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RESP_TOOL = {"content": "", "reasoning_content": "think", "tool_calls": [CALL]}
ASSIST_TOOL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "zz", "type": "function", "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'}}
    ],
}


def test_pair_user_reply():
    p = pair_next_state(
        [U],
        {"content": "Sunny."},
        [U, {"role": "assistant", "content": " Sunny.\n"}, {"role": "user", "content": "thanks"}],
    )
    assert p.kind == "paired" and p.next_state == [{"role": "user", "content": "thanks"}]


def test_pair_several_tool_results_and_dropped_system():
    new = [
        U,
        ASSIST_TOOL,
        {"role": "tool", "tool_call_id": "zz", "content": "18C"},
        {"role": "tool", "tool_call_id": "zz", "content": "sunny"},
        {"role": "system", "content": "reminder"},
    ]
    p = pair_next_state([U], RESP_TOOL, new)
    assert p.kind == "paired"
    assert [m["role"] for m in p.next_state] == ["tool", "tool"] and p.next_state[1]["content"] == "sunny"
    assert p.dropped == ["system"]


@pytest.mark.parametrize(
    "new,why",
    [
        (
            [
                {"role": "user", "content": "other question"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "ok"},
            ],
            "rewritten",
        ),
        ([U, {"role": "assistant", "content": "Edited reply"}, {"role": "user", "content": "ok"}], "assistant"),
        ([U, {"role": "assistant", "content": "Sunny."}], "expected more"),
        ([U, {"role": "assistant", "content": "Sunny."}, {"role": "system", "content": "x"}], "no user or tool"),
    ],
)
def test_pair_mismatch(new, why):
    p = pair_next_state([U], {"content": "Sunny."}, new)
    assert p.kind == "mismatch" and p.next_state is None and why in p.note


@pytest.mark.parametrize(
    "recorded,resent",
    [
        # OpenClaw hides an inline reasoning block and rejoins the text around it with a newline
        ("Sure. <think>check the units</think> It is 4.", "Sure. \nIt is 4."),
        ("a <thinking>x</thinking>b", "a b"),
        ("noise</think> tail", "noise</think> tail"),  # a stray closing tag is kept by clients, and compared
    ],
)
def test_a_reply_resent_without_its_inline_reasoning_still_pairs(recorded, resent):
    new = [U, {"role": "assistant", "content": resent}, {"role": "user", "content": "ok"}]
    p = pair_next_state([U], {"content": recorded}, new)
    assert p.kind == "paired" and p.next_state == [{"role": "user", "content": "ok"}]


@pytest.mark.parametrize("resent", ["Sure. It is 5.", "Sure.", "noise tail"])
def test_a_reply_with_its_visible_text_changed_is_a_mismatch(resent):
    new = [U, {"role": "assistant", "content": resent}, {"role": "user", "content": "ok"}]
    for recorded in ("Sure. <think>check</think> It is 4.", "noise</think> tail"):
        assert pair_next_state([U], {"content": recorded}, new).kind == "mismatch"


def test_a_reply_with_nothing_visible_may_be_left_out_of_the_resent_history():
    # OpenClaw drops an assistant message without text or calls (a reply that was all reasoning)
    recorded = {"content": "", "reasoning_content": "cut by max_tokens while thinking"}
    p = pair_next_state([U], recorded, [U, {"role": "user", "content": "hello?"}])
    assert p.kind == "paired" and p.next_state == [{"role": "user", "content": "hello?"}] and "left out" in p.note
    kept = pair_next_state([U], recorded, [U, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}])
    assert kept.kind == "paired" and kept.note is None
    # a reply with visible text must be there
    assert pair_next_state([U], {"content": "Sunny."}, [U, {"role": "user", "content": "x"}]).kind == "mismatch"
    assert pair_next_state([U], recorded, [U]).kind == "mismatch"  # no feedback at all


def _split(chunks: list[str], **kw: bool) -> tuple[str, str, list]:
    sp = StreamSplitter(**kw)
    parts = [p for c in chunks for p in sp.feed(c)]
    tail, calls = sp.finish()
    parts += tail
    kinds = [k for k, _ in parts]
    assert "reasoning" not in kinds[kinds.index("content") if "content" in kinds else len(kinds) :]
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"), calls)


@pytest.mark.parametrize(
    "text",
    [
        "<think>\nplan it\n</think>\n\nThe answer is 4.",
        "plain answer with < and <t chars",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<think>only reasoning, cut by max_tokens",
        "text then <tool_call>not json</tool_call> more",
        # a stray </think> (a reply that never opened the block): content, unless the prompt opened it
        " 750 854 52 263ast scoreqYes 974\n   bad 51 Resulsing</think> 34 890 713 no 56",
        'plan</think>\n\nanswer <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "<think>r</think>a</think>b",
        "answer <think>mid</think> more",
    ],
)
@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("parse_tools", [True, False])
def test_stream_splitter_matches_full_parse(text, opened, parse_tools):
    from engine.chat import DEFAULT_TOOL_PARSER, parse_assistant_output

    full = parse_assistant_output(text, opened=opened, tool_parser=DEFAULT_TOOL_PARSER if parse_tools else None)
    for size in (1, 3, 7, len(text)):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        reasoning, content, calls = _split(chunks, opened=opened, parse_tools=parse_tools)
        assert reasoning == (full.reasoning_content or "")
        assert content == full.content
        assert [c["function"] for c in calls] == [c["function"] for c in full.tool_calls]


def test_stream_splitter_never_leaks_tag_fragments():
    sp = StreamSplitter()
    out = sp.feed("<thi") + sp.feed("nk>abc</th") + sp.feed("ink>Hi <tool_") + sp.feed("call>{}")
    assert "".join(t for _, t in out) == "abcHi"


@pytest.mark.parametrize(
    "messages,msg",
    [
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r", "tool_call_id": "c9"}], "does not match"),
        ([{"role": "tool", "content": "r"}], "without tool_call_id"),
        ([{"role": "user", "content": 5}], "content must be"),
        ([{"role": "user"}], "needs content"),
        (
            [U, {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is required",
        ),
    ],
)
def test_validate_messages_rejects(messages, msg):
    with pytest.raises(InvalidRequest, match=msg):
        validate_messages(messages)


def test_validate_messages_accepts_tool_round_trip():
    out = validate_messages(
        [
            {"role": "developer", "content": "be brief"},
            U,
            ASSIST_TOOL,
            {"role": "tool", "tool_call_id": "zz", "content": "18C"},
        ]
    )
    assert out[0]["role"] == "system" and len(out) == 4


def test_settings_from_cli_and_env(monkeypatch):
    monkeypatch.setenv("HINDSIGHT_POLICY_MODE", "combine")
    monkeypatch.setenv("HINDSIGHT_POLICY_ENGINE_WORKER_URLS", "http://a:1,http://b:2")
    s = settings_from_args(
        ["--model-path", "m", "--engine-url", "http://r:9/", "--pause-mode", "retract", "--session-idle-timeout-s", "5"]
    )
    assert (s.mode, s.engine_url, s.engine_worker_urls, s.pause_mode, s.session_idle_timeout_s) == (
        "combine",
        "http://r:9",
        ["http://a:1", "http://b:2"],
        "retract",
        5.0,
    )
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
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "unit": {"enum": ["c", "f"]},
                        "limit": {"type": ["integer", "null"]},
                    },
                    "required": ["city", "days", "tags", "unit", "limit"],
                },
            },
        }
    ]
    g = forced_tool_grammar(tools, {"type": "function", "function": {"name": "get_weather"}})
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    ok = head + '{"city": "Paris", "days": 3, "tags": ["a", "b"], "unit": "c", "limit": null}}\n</tool_call>'
    assert _accepts(g, ok)
    assert json.loads(ok[len("<tool_call>\n") : -len("\n</tool_call>")])["arguments"]["tags"] == ["a", "b"]
    assert not _accepts(g, ok.replace('"days": 3', '"days": "3"'))  # integer, not a string
    assert not _accepts(g, ok.replace('["a", "b"]', '"a, b"'))  # array, not a string
    assert not _accepts(g, ok.replace('"unit": "c"', '"unit": "k"'))  # enum
    assert not _accepts(g, ok.replace(', "limit": null', ""))  # required
    assert not _accepts(g, ok.replace("</tool_call>", ""))  # the block is closed
    assert forced_tool_grammar(tools, "auto") is None and forced_tool_grammar(tools, None) is None
    with pytest.raises(InvalidRequest):
        forced_tool_grammar(tools, {"type": "function", "function": {"name": "nope"}})


def test_forced_tool_grammar_required_is_one_call_of_any_tool_and_empty_parameters():
    tools = [
        {"type": "function", "function": {"name": "a"}},
        {
            "type": "function",
            "function": {
                "name": "b",
                "parameters": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
            },
        },
    ]
    g = forced_tool_grammar(tools, "required")
    assert _accepts(g, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')
    assert _accepts(g, '<tool_call>\n{"name": "b", "arguments": {"x": true}}\n</tool_call>')
    assert not _accepts(g, '<tool_call>\n{"name": "a", "arguments": {"x": true}}\n</tool_call>')
    assert not _accepts(g, '<tool_call>\n{"name": "c", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({"type": "string"}, "type object"),
        ({"type": "object", "properties": {"x": {"type": "bogus"}}}, "cannot be constrained"),
        ({"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}, "outside the schema"),
    ],
)
def test_unconstrainable_tool_schema_is_a_400(parameters, fragment):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(InvalidRequest) as exc:
        forced_tool_grammar(tools, "required")
    assert fragment in exc.value.message and exc.value.param == "tools[0].function.parameters"


def test_response_format_grammar_is_the_schemas_grammar():
    assert response_format_grammar(None) is None and response_format_grammar({"type": "text"}) is None
    obj = response_format_grammar({"type": "json_object"})
    assert _accepts(obj, '{"k": [1, "v"]}') and not _accepts(obj, "[1]")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert _accepts(g, '{"n": 3}') and not _accepts(g, '{"n": "3"}') and not _accepts(g, "{}")
    for bad in (
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "yaml"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
    ):
        with pytest.raises(InvalidRequest):
            response_format_grammar(bad)


BOUNDED = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}


@pytest.mark.parametrize(
    "value, ok",
    [
        ('"abc"', True),
        ('"a\\nb"', True),  # an escape is one character of the three
        ('"\\u0041bc"', True),
        ('"a\\"b"', True),
        ('"abcd"', False),  # over maxLength
        ('"a\x0bb"', False),  # raw controls (U+0000-U+001F) are no JSON
        ('"a\x00"', False),
        ('"a\tb"', False),
        ('"a\\x"', False),  # not an escape JSON knows
    ],
)
def test_bounded_strings_are_json_strings_in_every_grammar(value, ok):
    """xgrammar's own grammar of a ``maxLength`` string admits raw control characters; the grammars sent to the
    engine (response formats and forced calls) admit exactly the JSON strings of at most that many characters."""
    fmt = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": BOUNDED}})
    assert _accepts(fmt, '{"s": ' + value + "}") is ok
    if ok:
        assert len(json.loads(value)) <= 3
    tools = [{"type": "function", "function": {"name": "f", "parameters": BOUNDED}}]
    call = '<tool_call>\n{"name": "f", "arguments": {"s": ' + value + "}}\n</tool_call>"
    assert _accepts(forced_tool_grammar(tools, "required"), call) is ok
