"""Unit: the Responses and Anthropic Messages adapters' conversions onto the one chat input (pure).

Contract (policy_server.api.responses.shapes, policy_server.api.messages.shapes): input items / blocks
become the chat messages a client of chat completions would have sent, so the render and the pairing
rule are the chat ones; an assistant reply sent back in either shape equals the recorded chat reply
under the pairing rule's message key; unsupported items, blocks, tools and fields are 400s naming them.
"""

from __future__ import annotations

import json

import pytest

from policy_server.api.messages import shapes as ms
from policy_server.api.responses import output as ro
from policy_server.api.responses import shapes as rs
from policy_server.errors import InvalidRequest
from policy_server.serving.pairing import message_key

pytestmark = pytest.mark.unit

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}}
RECORDED = {"content": "let me check", "reasoning_content": "think", "tool_calls": [CALL]}


def test_responses_string_input_is_one_user_message():
    assert rs.input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_responses_items_form_one_assistant_message_per_model_turn():
    items = ro.output_items("abc", {"role": "assistant", **RECORDED}, None)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    msgs = rs.input_messages(
        [
            {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": "weather?"},
            *items,
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assistant = msgs[2]
    assert assistant["reasoning_content"] == "think"
    assert message_key(assistant) == message_key({"role": "assistant", **RECORDED})  # pairs with the record
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([{"type": "item_reference", "id": "x"}], "item_reference"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input_image"),
        ([{"role": "tool", "content": "x"}], "role 'tool'"),
        ([{"type": "function_call", "name": "f"}], "call_id"),
    ],
)
def test_responses_unsupported_items_are_400(items, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        rs.input_messages(items)


def test_responses_request_fields():
    with pytest.raises(InvalidRequest, match="background") as exc:
        rs.parse_request({"input": "x", "background": True})
    assert exc.value.param == "background"
    with pytest.raises(InvalidRequest, match="include"):
        rs.parse_request({"input": "x", "include": ["file_search_call.results"]})
    req = rs.parse_request(
        {
            "input": "x",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "v", "schema": {"type": "object"}, "strict": True}},
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
            "reasoning": {"effort": "none"},
            "stream": True,
        }
    )
    body = rs.chat_body(req, [{"role": "user", "content": "x"}])
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["max_tokens"] == 9 and body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert body["reasoning_effort"] == "none" and body["stream_options"] == {"include_usage": True}
    with pytest.raises(InvalidRequest, match="web_search"):
        rs.chat_tools([{"type": "web_search"}])


def test_messages_thinking_becomes_reasoning_effort():
    def effort(thinking: dict | None) -> str | None:
        extra = {} if thinking is None else {"thinking": thinking}
        req = ms.parse_request({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **extra})
        return ms.prompt_body(req).get("reasoning_effort")

    assert effort({"type": "disabled"}) == "none"
    assert effort({"type": "enabled", "budget_tokens": 1024}) == "medium"
    assert effort({"type": "adaptive"}) is None and effort(None) is None


def test_messages_blocks_become_chat_messages():
    req = ms.parse_request(
        {
            "max_tokens": 5,
            "system": [{"type": "text", "text": "rules"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "think", "signature": ""},
                        {"type": "text", "text": "let me check"},
                        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"days": 2, "city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "call_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
        }
    )
    msgs = ms.chat_messages(req)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert message_key(msgs[2]) == message_key({"role": "assistant", **RECORDED})  # pairs with the record
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_messages_tool_choice_and_fields():
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    base = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": tools}
    choices = {
        "auto": "auto",
        "none": "none",
        "any": "required",
    }
    for kind, chat in choices.items():
        assert ms.chat_body(ms.parse_request({**base, "tool_choice": {"type": kind}}))["tool_choice"] == chat
    forced = ms.chat_body(
        ms.parse_request(
            {**base, "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True}}
        )
    )
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert forced["parallel_tool_calls"] is False
    assert forced["tools"][0]["function"]["parameters"] == {"type": "object"}
    with pytest.raises(InvalidRequest, match="max_tokens"):
        ms.parse_request({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(InvalidRequest, match="top_k"):
        ms.parse_request({**base, "top_k": 5})
    with pytest.raises(InvalidRequest, match="image"):
        ms.chat_messages(
            ms.parse_request({**base, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})
        )


def test_messages_output_blocks_and_stop_reasons():
    blocks = ms.content_blocks({"role": "assistant", **RECORDED})
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2]["input"] == json.loads(CALL["function"]["arguments"])
    assert ms.stop_reason("tool_calls", None, None) == ("tool_use", None)
    assert ms.stop_reason("length", None, None) == ("max_tokens", None)
    assert ms.stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert ms.stop_reason("stop", None, ["END"]) == ("end_turn", None)
    assert ms.tool_input("not json") == {"arguments": "not json"}
    assert ms.error_body(429, "slow down") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }


def test_responses_allowed_tools_offer_only_those_tools():
    tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("a", "b", "c")]
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "c"}, {"type": "function", "name": "a"}],
    }
    body = rs.chat_body(rs.parse_request({"input": "x", "tools": tools, "tool_choice": choice}), [])
    assert [t["function"]["name"] for t in body["tools"]] == ["a", "c"] and body["tool_choice"] == "required"
    with pytest.raises(InvalidRequest, match="undeclared tool"):
        rs.chat_body(rs.parse_request({"input": "x", "tools": tools[:1], "tool_choice": choice}), [])
