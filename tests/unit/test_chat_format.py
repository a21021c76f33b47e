"""engine.chat: the tiny model's template (Qwen3's own) renders every role, and sampled text splits into reasoning/content/tool calls."""

from __future__ import annotations

import json

import pytest

from engine.chat import (
    HermesToolCallParser,
    ThinkReasoningParser,
    parse_assistant_output,
    prompt_opens_think,
    render_prompt_ids,
    render_prompt_text,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from engine.chat import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def test_render_all_roles_and_tools(tokenizer):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = render_prompt_text(tokenizer, msgs, tools)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    # consecutive tool results share one user turn
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 2
    assert text.endswith("<|im_start|>assistant\n")
    ids = render_prompt_ids(tokenizer, msgs, tools)
    assert tokenizer.decode(ids) == text  # ids are exactly the rendered text, no extra specials


def test_enable_thinking_false_prefills_empty_think(tokenizer):
    text = render_prompt_text(
        tokenizer, [{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": False}
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_markers_are_single_tokens(tokenizer):
    for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker


@pytest.mark.parametrize(
    "text,content,reasoning,n_calls",
    [
        ("plain answer", "plain answer", None, 0),
        ("<think>\nplan\n</think>\n\nanswer", "answer", "plan", 0),
        ("<think>cut off by max tokens", "", "cut off by max tokens", 0),
        ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "", None, 1),
        ('ok <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>', "ok", None, 2),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", None, 0),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', None, 0),
        ('<think>r</think>text <tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call>', "text", "r", 1),
    ],
)
def test_parse_assistant_output(text, content, reasoning, n_calls):
    out = parse_assistant_output(text)
    assert out.content == content
    assert out.reasoning_content == reasoning
    assert len(out.tool_calls) == n_calls
    for i, call in enumerate(out.tool_calls):
        assert call["index"] == i and call["type"] == "function"
        json.loads(call["function"]["arguments"])  # arguments are a JSON string, as OpenAI sends them


def test_parsers_are_pluggable():
    out = parse_assistant_output("<think>x</think>y", reasoning_parser=None, tool_parser=None)
    assert out.content == "<think>x</think>y" and out.reasoning_content is None
    assert ThinkReasoningParser().split("no think") == (None, "no think")
    assert HermesToolCallParser().extract("nothing")[1] == []


def test_tool_call_with_raw_control_character_in_a_string_is_parsed_and_re_escaped():
    # xgrammar admits raw control characters inside length-bounded JSON strings; they are data, not a broken call.
    parsed = parse_assistant_output('<tool_call>\n{"name": "f", "arguments": {"s": "a\x07b"}}\n</tool_call>')
    [call] = parsed.tool_calls
    assert call["function"]["arguments"] == '{"s": "a\\u0007b"}'
    assert json.loads(call["function"]["arguments"]) == {"s": "a\x07b"} and parsed.content == ""


@pytest.mark.parametrize(
    "body,arguments",
    [
        # a literal past float range decodes to inf; json.dumps would write Infinity, which is not JSON
        ('{"name": "f", "arguments": {"lat": 8257E7879, "n": 1}}', '{"lat": 8257E7879, "n": 1}'),
        ('{"name": "f", "arguments": {"a": [-1e999]}, "arguments": {"b": 2e400}}', '{"b": 2e400}'),  # last key wins
        ('{"name": "f", "parameters": {"x": 1E+9999}}', '{"x": 1E+9999}'),
        ('{"name": "f", "arguments": {"x": 1.5e3}}', '{"x": 1500.0}'),  # finite: re-serialized as before
        # the rest is still re-serialized: a raw control character in a string is escaped
        ('{"name": "f", "arguments": {"s": "a\x07b", "x": 1e999}}', '{"s": "a\\u0007b", "x": 1e999}'),
    ],
)
def test_tool_call_arguments_stay_json_when_a_number_overflows_a_float(body, arguments):
    [call] = parse_assistant_output(f"<tool_call>\n{body}\n</tool_call>").tool_calls
    assert call["function"]["arguments"] == arguments
    json.loads(call["function"]["arguments"], parse_constant=pytest.fail)  # strict JSON: no Infinity/NaN


@pytest.mark.parametrize("constant", ["Infinity", "-Infinity", "NaN"])
def test_a_call_with_a_non_json_constant_stays_content(constant):
    text = f'<tool_call>{{"name": "f", "arguments": {{"x": {constant}}}}}</tool_call>'
    out = parse_assistant_output(text)
    assert out.tool_calls == [] and out.content == text


@pytest.mark.parametrize(
    "text,opened,content,reasoning",
    [
        # the reply did not open a block and the prompt did not either: a stray </think> is text
        ("plan</think>\nanswer", False, "plan</think>\nanswer", None),
        ("plan</think>\nanswer", True, "answer", "plan"),
        ("still thinking, cut by max tokens", True, "", "still thinking, cut by max tokens"),
        ("<think>r</think>a</think>b", False, "a</think>b", "r"),
        ("<think>r</think>a", True, "a", "r"),  # the block opened twice: once is enough
        ("answer <think>mid</think> more", False, "answer <think>mid</think> more", None),
    ],
)
def test_the_prompt_decides_whether_the_reply_starts_in_reasoning(text, opened, content, reasoning):
    out = parse_assistant_output(text, opened=opened)
    assert (out.content, out.reasoning_content) == (content, reasoning)


def test_prompt_opens_think_reads_the_rendered_prompt(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    plain = render_prompt_ids(tokenizer, msgs)
    assert not prompt_opens_think(tokenizer, plain)
    # enable_thinking=false closes the block in the prompt: the reply is content
    closed = render_prompt_ids(tokenizer, msgs, chat_template_kwargs={"enable_thinking": False})
    assert not prompt_opens_think(tokenizer, closed)
    # a template that starts every reply in reasoning (DeepSeek-R1, Qwen3 thinking-only) ends with <think>\n
    opened = plain + tokenizer.encode("<think>\n", add_special_tokens=False)
    assert prompt_opens_think(tokenizer, opened)
