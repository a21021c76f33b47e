"""Unit: the Responses and Messages event streams built from chat chunks (pure; no server).

Contract (policy_server.api.responses.stream, policy_server.api.messages.stream): reasoning, text and tool
calls of one chat stream become the SDKs' event sequences, every event valid under the SDKs' own typed
models; an in-band chat error becomes ``response.failed`` / an Anthropic ``error`` event; the chat stream is
read to its end in every case (it settles its turn there).
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import pydantic
import pytest

from policy_server.api.messages import shapes as ms
from policy_server.api.messages.stream import message_events
from policy_server.api.responses import output as ro
from policy_server.api.responses import shapes as rs
from policy_server.api.responses.stream import ResponseEvents, response_events

pytestmark = pytest.mark.unit

CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
LP = {"token": "a", "bytes": [97], "logprob": -0.5, "top_logprobs": [{"token": "b", "bytes": [98], "logprob": -1.0}]}


def chunk(delta=None, finish=None, logprobs=None):
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": logprobs}]}


CHUNKS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "hmm"}),
    chunk({"content": "a"}, logprobs={"content": [LP]}),
    chunk({"content": "b"}),
    chunk({"tool_calls": [CALL]}),
    chunk({}, finish="tool_calls"),
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
]


class Source:
    """The chat chunks, recording whether they were read to the end."""

    def __init__(self, chunks):
        self.chunks, self.exhausted = chunks, False

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        self.exhausted = True


def parse(text: list[str]) -> list[dict]:
    out = []
    for block in text:
        kind, data = block.strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


@functools.cache
def response_events_adapter() -> pydantic.TypeAdapter[Any]:
    """The openai SDK's Responses stream event union, imported on first use: the SDKs' typed models cost every
    pytest-xdist worker seconds of CPU when imported at collection."""
    from openai.types.responses import ResponseStreamEvent

    return pydantic.TypeAdapter(ResponseStreamEvent)


@functools.cache
def message_events_adapter() -> pydantic.TypeAdapter[Any]:
    """The anthropic SDK's Messages stream event union, imported on first use (as above)."""
    from anthropic.types import RawMessageStreamEvent

    return pydantic.TypeAdapter(RawMessageStreamEvent)


async def collect(agen) -> list[str]:
    return [e async for e in agen]


def responses(chunks, stored: list) -> tuple[list[dict], Source]:
    req = rs.parse_request({"input": "x", "include": ["message.output_text.logprobs"]})
    build = functools.partial(ro.response_object, req, rid="resp_1", model="m")
    events = ResponseEvents(build, "1", logprobs=True)

    async def store(message):
        stored.append(message)

    src = Source(chunks)
    return parse(asyncio.run(collect(response_events(src.__aiter__(), events, store)))), src


def test_responses_events_reasoning_text_call():
    stored: list = []
    events, src = responses(CHUNKS, stored)
    adapter = response_events_adapter()
    for e in events:
        adapter.validate_python(e)
    assert src.exhausted
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["usage"]["total_tokens"] == 12
    out = final["response"]["output"]
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"]
    assert out[1]["content"][0]["text"] == "ab" and out[1]["content"][0]["logprobs"][0]["logprob"] == -0.5
    assert out[2]["call_id"] == "call_1" and out[2]["arguments"] == '{"x": 1}'
    assert stored == [
        {
            "role": "assistant",
            "content": "ab",
            "reasoning_content": "hmm",
            "tool_calls": [{k: CALL[k] for k in ("id", "type", "function")}],
        }
    ]


def test_responses_in_band_error_fails_and_still_drains():
    stored: list = []
    events, src = responses([CHUNKS[0], CHUNKS[2], {"error": {"message": "engine down"}}, CHUNKS[5]], stored)
    assert src.exhausted and stored == []
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["message"] == "engine down"
    response_events_adapter().validate_python(events[-1])


def test_messages_events_thinking_text_tool_use():
    start = ms.message_object(
        mid="msg_1", model="m", content=[], stop=(None, None), usage={"input_tokens": 5, "output_tokens": 0}
    )
    src = Source(CHUNKS)
    events = parse(
        asyncio.run(collect(message_events(src.__aiter__(), start, lambda f: ms.stop_reason(f, None, None))))
    )
    adapter = message_events_adapter()
    for e in events:
        adapter.validate_python(e)
    assert src.exhausted
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    json_deltas = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert [json.loads(d) for d in json_deltas] == [{"x": 1}]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 7
    assert events[-1]["type"] == "message_stop"
