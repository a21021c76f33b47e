"""Tool-call and reasoning parsers per family (engine.tool_parsers) and the family detected from each shared template.

Contract: a forced call's markup (``call_markup``) is what the family's grammar admits and what its parser reads
back as one call with the arguments as JSON text; the content around a call is kept; a block that does not
parse stays content; ids come in the family's form (Mistral: 9 alphanumerics). The family is detected from
the markup the template writes, and an operator's parser names override it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from xgrammar.testing import _is_grammar_accept_string

from engine.chat import parse_assistant_output
from engine.chat_families import TOOL_CALL_PARSERS, ChatFamily, detect_family, resolve_family
from engine.tool_grammar import forced_tool_grammar
from engine.tool_parsers import call_markup, reasoning_parser, tool_call_parser
from tests.testkit.chat_templates import TEMPLATES_DIR, TOOLS

pytestmark = pytest.mark.unit
ARGS = {"to": "b.txt"}


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_forced_markup_is_admitted_and_parses_back(name: str) -> None:
    head, tail = call_markup(name, "rename")
    call = head + json.dumps(ARGS) + tail
    grammar = forced_tool_grammar(TOOLS, {"type": "function", "function": {"name": "rename"}}, name)
    assert grammar is not None and _is_grammar_accept_string(grammar, call)
    assert not _is_grammar_accept_string(grammar, call.replace("rename", "remove", 1))
    before = "" if name == "llama3" else "I will rename it. "  # Llama 3's bare calls are the whole reply
    content, calls = tool_call_parser(name).extract(before + call)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("rename", ARGS)]
    assert content == before.strip()
    assert calls[0]["type"] == "function" and calls[0]["index"] == 0


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("llama3", 'I think {"name": "rename", "parameters": {"to": "x"}} is right'),
        ("mistral", '[TOOL_CALLS][{"name": "rename", "arguments": {"to": "x"'),
        ("deepseekv31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rename<｜tool▁sep｜>{bad}<｜tool▁call▁end｜>"),
        ("deepseekv3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>rename\n```json\n{"to": 1}'),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.rename:0{}"),
        ("gpt-oss", "<|channel|>commentary to=functions.rename <|constrain|>json<|message|>not json"),
        ("qwen25", '<tool_call>\n{"name": 3}\n</tool_call>'),
    ],
)
def test_a_block_that_does_not_parse_stays_content(name: str, text: str) -> None:
    assert tool_call_parser(name).extract(text) == (text, [])


def test_ids_take_the_family_form() -> None:
    mistral = tool_call_parser("mistral", "mistral").extract('[TOOL_CALLS][{"name": "a", "arguments": {}}]')[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral[0]["id"])
    kimi = tool_call_parser("kimi_k2").extract(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )[1]
    assert [c["id"] for c in kimi] == ["functions.a:0", "functions.b:1"]
    assert [c["function"]["name"] for c in kimi] == ["a", "b"]
    hermes = tool_call_parser("qwen25").extract('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')[1]
    assert re.fullmatch(r"call_[0-9a-f]{24}", hermes[0]["id"])


def test_llama3_calls_separated_by_semicolons_and_python_tag() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    content, calls = tool_call_parser("llama3").extract(text)
    assert content == "" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_harmony_reasoning_is_the_analysis_channel() -> None:
    text = "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>"
    parsed = parse_assistant_output(text, reasoning_parser=reasoning_parser("gpt-oss"), tool_parser=None)
    assert (parsed.reasoning_content, parsed.content) == ("think hard", "42")
    plain = parse_assistant_output("<think>a</think>b", reasoning_parser=reasoning_parser("qwen3"), tool_parser=None)
    assert (plain.reasoning_content, plain.content) == ("a", "b")
    assert reasoning_parser(None) is None


EXPECTED = {
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("qwen25", None),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("qwen25", None),
    "Qwen-Qwen3-0.6B.jinja": ("qwen25", "qwen3"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("deepseekv3", "deepseek-r1"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("deepseekv31", "deepseek-r1"),
    "google-gemma-2-2b-it.jinja": ("qwen25", "qwen3"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", None),
    "moonshotai-Kimi-K2.jinja": ("kimi_k2", None),
    "openai-gpt-oss-120b.jinja": ("gpt-oss", "gpt-oss"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_family_is_detected_from_the_template(name: str) -> None:
    family = detect_family((TEMPLATES_DIR / name).read_text())
    assert (family.tool_call_parser, family.reasoning_parser) == EXPECTED[name]
    assert family.id_form == ("mistral" if "Mistral" in name else "openai")


class _Tok:
    chat_template: Any = {"default": "{{ 'x' }}", "tool_use": "[TOOL_CALLS] {{ 'y' }}"}


def test_operator_names_override_detection() -> None:
    assert resolve_family(_Tok()) == ChatFamily("mistral", None, "mistral")  # any of a multi-template config
    assert resolve_family(_Tok(), "llama3", "none") == ChatFamily("llama3", None, "mistral")
    assert resolve_family(_Tok(), "qwen25", "qwen3").reasoning_parser == "qwen3"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "rename", "arguments": {"to": "b"}}]'),
        ("llama3", '{"name": "rename", "parameters": {"to": "b"}}'),
        (
            "kimi_k2",
            "Sure. "
            + "".join(call_markup("kimi_k2", "rename")).replace("<|tool_call_end|>", '{"to": "b"}<|tool_call_end|>', 1),
        ),
    ],
)
def test_streaming_holds_a_call_from_the_family_marker(name: str, text: str) -> None:
    from policy_server.api.chat.streaming import StreamSplitter

    splitter = StreamSplitter(tool_parser=tool_call_parser(name), reasoning_parser=None)
    sent = [d for i in range(0, len(text), 3) for kind, d in splitter.feed(text[i : i + 3]) if kind == "content"]
    last, calls = splitter.finish()
    streamed = "".join(sent) + "".join(d for _, d in last)
    assert streamed == ("Sure." if text.startswith("Sure.") else "")  # the markup never reaches the client as text
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("rename", {"to": "b"})]


def test_streaming_harmony_holds_the_channels_and_splits_them_at_the_end() -> None:
    from policy_server.api.chat.streaming import StreamSplitter

    text = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>42"
    splitter = StreamSplitter(tool_parser=tool_call_parser("gpt-oss"), reasoning_parser=reasoning_parser("gpt-oss"))
    assert [d for i in range(0, len(text), 4) for d in splitter.feed(text[i : i + 4])] == []
    last, calls = splitter.finish()
    assert last == [("reasoning", "think"), ("content", "42")] and calls == []
