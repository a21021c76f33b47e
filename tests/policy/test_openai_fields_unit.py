"""policy_server.api.openai_fields (pure): unknown fields are named in a 400, each new field validates and maps to
the engine parameters the module docstring promises; log-prob entries are OpenAI's shape; the chat route's
OpenAPI body schema documents exactly the accepted fields (plus the session fallbacks) and no others."""

from __future__ import annotations

import pytest

from engine.chat_families import ChatFamily
from policy_server.api.openai_fields import (
    PARALLEL_STOP,
    apply_extras,
    chat_request_schema,
    chat_template_kwargs,
    hindsight_headers,
    known_fields,
    parse_extras,
    token_logprobs,
)
from policy_server.errors import InvalidRequest

pytestmark = pytest.mark.unit
BASE = {"messages": [{"role": "user", "content": "x"}]}


def test_unknown_fields_are_named_sorted():
    with pytest.raises(InvalidRequest) as exc:
        parse_extras({**BASE, "top_k": 2, "audio": {}, "temperature": 1})
    assert "audio, top_k" in exc.value.message and exc.value.param == "audio"


def test_openapi_chat_body_documents_every_accepted_field_and_no_other():
    schema = chat_request_schema()
    assert set(schema["properties"]) == known_fields() | {"session_id", "turn_type", "session_done"}
    assert schema["additionalProperties"] is False  # any other field is a 400
    assert schema["required"] == ["messages"]
    top = schema["properties"]["top_logprobs"]["anyOf"][0]
    assert (top["minimum"], top["maximum"]) == (0, 20)
    assert "xhigh" in schema["properties"]["reasoning_effort"]["anyOf"][0]["enum"]


def test_known_fields_pass():
    e = parse_extras(
        {
            **BASE,
            "logprobs": True,
            "top_logprobs": 2,
            "reasoning_effort": "low",
            "user": "u",
            "store": False,
            "metadata": {"a": "b"},
            "parallel_tool_calls": False,
            "response_format": {"type": "text"},
            "logit_bias": {"3": -1.5},
            "stream": False,
        }
    )
    assert e.top_logprobs == 2 and e.metadata == {"a": "b"} and e.logit_bias == {"3": -1.5}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"top_logprobs": 1}, "top_logprobs"),  # needs logprobs
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"3": -100.5}}, "logit_bias"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_values(body, param):
    with pytest.raises(InvalidRequest) as exc:
        parse_extras({**BASE, **body})
    assert exc.value.param == param


def test_apply_extras_maps_to_engine_params():
    sp = {"max_new_tokens": 8, "stop": ["END"]}
    apply_extras(
        parse_extras({**BASE, "logit_bias": {"7": 2}, "parallel_tool_calls": False}),
        sp,
        vocab_size=10,
        forced_tools=False,
        tools=True,
        behind_router=False,
        keep_special_tokens=True,
    )
    assert sp == {
        "max_new_tokens": 8,
        "stop": ["END", PARALLEL_STOP],
        "no_stop_trim": True,
        "logit_bias": {"7": 2.0},
        "skip_special_tokens": False,
    }
    sp = {"max_new_tokens": 8}
    apply_extras(
        parse_extras({**BASE, "parallel_tool_calls": False}),
        sp,
        vocab_size=10,
        forced_tools=True,
        tools=True,
        behind_router=False,
        keep_special_tokens=False,
    )
    assert sp == {"max_new_tokens": 8}  # a forced call is exactly one already
    for kw in ({"vocab_size": 7, "behind_router": False}, {"vocab_size": 10, "behind_router": True}):
        with pytest.raises(InvalidRequest):
            apply_extras(
                parse_extras({**BASE, "logit_bias": {"7": 2}}),
                {},
                forced_tools=False,
                tools=False,
                keep_special_tokens=False,
                **kw,
            )


@pytest.mark.parametrize(
    ("parser", "reasoning", "tools_active", "keep"),
    [
        ("mistral", None, True, True),  # [TOOL_CALLS] is a special token of Mistral's tokenizers
        ("qwen25", "qwen3", True, True),
        ("qwen25", "qwen3", False, False),  # plain chat decodes as the engine's default
        ("gpt-oss", "gpt-oss", False, True),  # its channels are special tokens, with or without tools
    ],
)
def test_special_tokens_kept_where_the_markup_needs_them(parser, reasoning, tools_active, keep):
    assert ChatFamily(parser, reasoning).keeps_special_tokens(tools_active) is keep


def test_reasoning_effort_template_kwargs():
    def kwargs(switch: str | None, **effort: str) -> object:
        return chat_template_kwargs(parse_extras({**BASE, **effort}), switch)

    assert kwargs("enable_thinking", reasoning_effort="none") == {"enable_thinking": False}
    assert kwargs("enable_thinking", reasoning_effort="minimal") == {"enable_thinking": False}
    assert kwargs("enable_thinking", reasoning_effort="high") == {"enable_thinking": True}
    assert kwargs("thinking", reasoning_effort="low") == {"thinking": True}
    assert kwargs("reasoning_effort", reasoning_effort="none") == {"reasoning_effort": "low"}
    assert kwargs(None, reasoning_effort="none") is None  # a template without a switch
    assert kwargs("enable_thinking") is None  # no field: the template's default


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return {1: "hé", 2: "!", 3: "x"}[ids[0]]


def test_token_logprobs_shape():
    out = token_logprobs(_Tok(), [1, 2], [-0.5, -1.0], [[(-0.5, 1), (-2.0, 3)], [(-0.1, 3)]])
    he = {"token": "hé", "bytes": [104, 195, 169]}
    x = {"token": "x", "bytes": [120]}
    assert out == [
        {**he, "logprob": -0.5, "top_logprobs": [{**he, "logprob": -0.5}, {**x, "logprob": -2.0}]},
        {"token": "!", "bytes": [33], "logprob": -1.0, "top_logprobs": [{**x, "logprob": -0.1}]},
    ]
    assert token_logprobs(_Tok(), [3], [-0.2], None)[0]["top_logprobs"] == []


def test_hindsight_headers():
    assert hindsight_headers("v1", "s") == {"X-Hindsight-Weight-Version": "v1", "X-Hindsight-Session-Id": "s"}
    assert hindsight_headers(None, "sé") == {}  # not latin-1 safe: only the body field carries it
