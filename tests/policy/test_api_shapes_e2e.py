"""End-to-end: the OpenAI Responses and Anthropic Messages routes with the real SDKs and agent frameworks
(openai ``responses.create``/``responses.stream``, openai-agents' default Responses model, pydantic-ai's
Responses model, anthropic ``messages.create``/``messages.stream``) against the real policy server ->
sglang-router -> dev engine.

Contract (docs/CLIENTS.md "Responses and Anthropic Messages"): each shape is an adapter onto the one chat
turn, so a tool loop through it is recorded token-exact and paired like a chat loop, a session may mix
shapes, and a stored response continues its session through ``previous_response_id``. Conformance: every
body and stream event the server sends validates against the SDKs' own typed models
(``openai.types.responses``, ``anthropic.types``), with pydantic's validation (the SDKs themselves build
their objects without validating).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import httpx2
import openai
import pydantic
import pytest

from policy_server.store import Store
from tests.testkit.procs import metric_value
from tests.testkit.servers import (
    CLIENT_KEY,
    async_openai_client,
    client,
    judged_policy_stack,
    lease_all,
    of_session,
    openai_client,
)
from tests.waiting import wait_until

if TYPE_CHECKING:
    import anthropic

# anthropic, openai-agents and the openai.types models are imported where a test uses them, not at collection:
# their thousands of pydantic classes cost every pytest-xdist worker seconds of CPU to import, test or not.
pytestmark = pytest.mark.e2e

MODEL = "hindsight-policy"
Short = Annotated[str, pydantic.Field(max_length=8)]
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "Weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER_ANTHROPIC = {
    "name": "weather",
    "description": "Weather of a city.",
    "input_schema": WEATHER["parameters"],
}


@functools.cache
def stream_events() -> pydantic.TypeAdapter[Any]:
    """The openai SDK's Responses stream event union, as a validator."""
    from openai.types.responses import ResponseStreamEvent

    return pydantic.TypeAdapter(ResponseStreamEvent)


@functools.cache
def message_events() -> pydantic.TypeAdapter[Any]:
    """The anthropic SDK's Messages stream event union, as a validator."""
    from anthropic.types import RawMessageStreamEvent

    return pydantic.TypeAdapter(RawMessageStreamEvent)


def oai(policy, sid: str | None = None) -> openai.OpenAI:
    return openai_client(policy.url, timeout_s=120, headers={"X-Session-Id": sid} if sid else None)


def claude(policy, sid: str | None = None, **kw) -> anthropic.Anthropic:
    import anthropic

    headers = {"X-Session-Id": sid} if sid else None
    return anthropic.Anthropic(
        base_url=policy.url,
        api_key=kw.pop("api_key", CLIENT_KEY),
        max_retries=0,
        timeout=120,
        default_headers=headers,
        http_client=httpx2.Client(trust_env=False),  # the anthropic SDK runs on httpx2
        **kw,
    )


def store(policy) -> Store:
    return Store(policy.log_path.parent / "data")


def end_session(policy, sid: str) -> None:
    with client(policy.url) as c:
        r = c.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": sid, "X-Turn-Type": "side", "X-Session-Done": "true"},
            json={"messages": [{"role": "user", "content": "end"}], "max_tokens": 1},
        )
    assert r.status_code == 200, r.text


def sse(policy, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The raw events of a streaming answer (``data:`` JSON), for validation against the SDK types."""
    events = []
    with client(policy.url) as c, c.stream("POST", path, json=body, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == kind
                events.append(data)
    return events


def check_paired_call(policy, sid: str, result_text: str) -> dict:
    """Turn 0 of ``sid`` is a forced call, recorded token-exact and paired with the tool result."""
    first = store(policy).get_turn(sid, 0)
    assert first.response["tool_calls"] and first.constrained is True
    assert len(first.response_ids) == len(first.rollout_logprobs) > 0
    assert first.pairing == "paired", first.pairing_note
    assert [m["role"] for m in first.next_state] == ["tool"]
    assert first.next_state[0]["content"] == result_text
    return first


# ---------------------------------------------------------------------------------------------- Responses
def test_responses_create_conforms_and_reports_usage(policy):
    from openai.types.responses import Response

    raw = oai(policy).responses.with_raw_response.create(
        model=MODEL,
        input="hello",
        instructions="Be brief.",
        max_output_tokens=6,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        metadata={"k": "v"},
    )
    body = raw.http_response.json()
    resp = Response.model_validate(body)  # the SDK's own schema, validated
    assert resp.object == "response" and resp.metadata == {"k": "v"}
    assert resp.status in ("completed", "incomplete")
    assert resp.usage is not None and resp.usage.output_tokens == 6 == resp.usage.total_tokens - resp.usage.input_tokens
    assert resp.usage.input_tokens > 2
    text_items = [o for o in resp.output if o.type == "message"]
    if text_items:
        lps = text_items[0].content[0].logprobs
        assert lps and all(len(lp.top_logprobs) == 2 for lp in lps)


def test_responses_stream_event_sequence(policy):
    events = sse(policy, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 8, "stream": True})
    for e in events:
        stream_events().validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["usage"]["output_tokens"] == 8
    texts = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = [e["text"] for e in events if e["type"] == "response.output_text.done"]
    assert done == ([texts] if texts else [])

    # The SDK's own stream helper accumulates the same events (the budget ends this answer: incomplete,
    # which the helper's get_final_response() refuses by design, so its last event is read instead).
    with oai(policy).responses.stream(model=MODEL, input="hi", max_output_tokens=8) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage is not None and last.response.usage.output_tokens == 8


def test_responses_forced_call_streamed(policy):
    events = sse(
        policy,
        "/v1/responses",
        {
            "model": MODEL,
            "input": "weather?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "weather"},
            "max_output_tokens": 200,
            "stream": True,
        },
    )
    for e in events:
        stream_events().validate_python(e)
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    args = next(e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done")
    parsed = json.loads(args)  # decoded under the tool's schema
    assert isinstance(parsed["city"], str) and isinstance(parsed["days"], int)
    assert events[-1]["type"] == "response.completed"


def _forced_weather(c: openai.OpenAI, input_items, **kw):
    return c.responses.create(
        model=MODEL,
        input=input_items,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=200,
        **kw,
    )


def test_responses_tool_loop_resending_history(policy):
    from openai.types.responses import Response

    sid = "resp-loop-history"
    c = oai(policy, sid)
    history: list = [{"role": "user", "content": "weather in Oslo?"}]
    first = _forced_weather(c, history)
    call = next(o for o in first.output if o.type == "function_call")
    history += [o.model_dump(exclude_none=True) for o in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    second = c.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=6)
    Response.model_validate(second.model_dump())
    end_session(policy, sid)
    check_paired_call(policy, sid, "sunny")
    assert store(policy).get_turn(sid, 1) is not None


def test_responses_tool_loop_with_previous_response_id(policy):
    sid = "resp-loop-chain"
    first = _forced_weather(oai(policy, sid), "weather in Rome?")
    call = next(o for o in first.output if o.type == "function_call")
    # No session header: the stored response's session continues; nothing but the new item is resent.
    second = oai(policy).responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
        tools=[WEATHER],
        max_output_tokens=6,
    )
    assert second.previous_response_id == first.id
    third = oai(policy).responses.create(
        model=MODEL, previous_response_id=second.id, input="thanks", max_output_tokens=4
    )
    assert third.status in ("completed", "incomplete")
    end_session(policy, sid)
    check_paired_call(policy, sid, "rain")
    st = store(policy)
    assert st.get_turn(sid, 1).pairing == "paired"  # the chained reply, paired with "thanks"
    assert st.get_turn(sid, 1).messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "rain"}


def test_responses_parse_structured_output(policy):
    """``text.format`` json_schema is constrained decoding: the SDK's ``responses.parse`` gets its model back."""

    class Pick(pydantic.BaseModel):
        tag: Literal["a", "b"]
        urgent: bool

    parsed = oai(policy).responses.parse(model=MODEL, input="pick one", text_format=Pick, max_output_tokens=200)
    assert isinstance(parsed.output_parsed, Pick)


def test_responses_errors_name_the_field(policy):
    c = oai(policy)
    with pytest.raises(openai.BadRequestError, match="unsupported field.*background"):
        c.responses.create(model=MODEL, input="x", extra_body={"background": True})
    with pytest.raises(openai.BadRequestError, match="input_image"):
        c.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}],
        )
    with pytest.raises(openai.BadRequestError, match="web_search"):
        c.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


def test_openai_agents_default_responses_model_with_tool(policy):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise try to export traces to api.openai.com

    calls: list[dict] = []

    @function_tool
    def place_order(items: list[Short], urgent: bool) -> str:
        """Place an order.

        Args:
            items: what to order
            urgent: rush it
        """
        calls.append({"items": items, "urgent": urgent})
        return "order placed"

    aclient = async_openai_client(policy.url)
    agent = Agent(
        name="shop",
        instructions="Use the tool.",
        tools=[place_order],
        model=OpenAIResponsesModel(model=MODEL, openai_client=aclient),
        model_settings=ModelSettings(
            tool_choice="place_order", max_tokens=200, extra_headers={"X-Session-Id": "agents-responses"}
        ),
    )
    result = Runner.run_sync(agent, "order two widgets", max_turns=3)
    assert calls and isinstance(calls[0]["items"], list) and isinstance(calls[0]["urgent"], bool)
    assert isinstance(result.final_output, str)
    end_session(policy, "agents-responses")
    check_paired_call(policy, "agents-responses", "order placed")


def test_pydantic_ai_responses_model_tool_loop(policy):
    """pydantic-ai's Responses model: its output tool is a forced call; the output validator asks for one retry,
    which pydantic-ai sends back as the call's function_call_output, so the run is a two-turn tool loop."""
    from pydantic_ai import Agent as PAgent
    from pydantic_ai import ModelRetry
    from pydantic_ai.models.openai import OpenAIResponsesModel as PResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Verdict(pydantic.BaseModel):
        ok: bool
        tag: Literal["a", "b"]

    sid = "pydantic-ai-responses"
    provider = OpenAIProvider(
        base_url=policy.url + "/v1", api_key=CLIENT_KEY, http_client=httpx2.AsyncClient(trust_env=False, timeout=120)
    )
    agent = PAgent(PResponsesModel(MODEL, provider=provider), output_type=Verdict, retries=3)
    attempts: list[Verdict] = []

    @agent.output_validator
    def once_more(v: Verdict) -> Verdict:
        attempts.append(v)
        if len(attempts) == 1:
            raise ModelRetry("check again")
        return v

    result = agent.run_sync("judge it", model_settings={"max_tokens": 200, "extra_headers": {"X-Session-Id": sid}})
    assert isinstance(result.output, Verdict) and len(attempts) == 2
    end_session(policy, sid)
    first = store(policy).get_turn(sid, 0)
    assert first.pairing == "paired", first.pairing_note
    assert "check again" in first.next_state[0]["content"]  # the retry prompt, as the call's tool result
    check_paired_call(policy, sid, first.next_state[0]["content"])
    assert store(policy).get_turn(sid, 1).response["tool_calls"]


# ---------------------------------------------------------------------------------------------- Messages
def test_messages_create_conforms(policy):
    from anthropic.types import Message

    raw = claude(policy).messages.with_raw_response.create(
        model=MODEL, max_tokens=5, system="Be brief.", messages=[{"role": "user", "content": "hello"}]
    )
    msg = Message.model_validate(raw.http_response.json())
    assert msg.usage.output_tokens == 5 and msg.usage.input_tokens > 2
    assert msg.stop_reason == "max_tokens"


def test_messages_stream_event_sequence(policy):
    events = sse(
        policy,
        "/v1/messages",
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    for e in events:
        message_events().validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2]["usage"]["output_tokens"] == 8
    with claude(policy).messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 8 and final.stop_reason == "max_tokens"


def test_messages_tool_use_loop_streamed_and_not(policy):
    from anthropic.types import Message

    sid = "messages-loop"
    c = claude(policy, sid)
    convo: list = [{"role": "user", "content": "weather in Oslo?"}]
    with c.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=convo,
        tools=[WEATHER_ANTHROPIC],
        tool_choice={"type": "tool", "name": "weather"},
    ) as stream:
        first = stream.get_final_message()
    Message.model_validate(first.model_dump())
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert isinstance(use.input["city"], str) and isinstance(use.input["days"], int)
    convo += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    second = c.messages.create(model=MODEL, max_tokens=6, messages=convo, tools=[WEATHER_ANTHROPIC])
    Message.model_validate(second.model_dump())
    end_session(policy, sid)
    check_paired_call(policy, sid, "sunny")


def test_messages_errors_in_anthropic_shape(policy):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as auth:
        claude(policy, api_key="wrong").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(policy).messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "image" in bad.value.body["error"]["message"]
    with client(policy.url) as c:  # max_tokens is required, as Anthropic's API has it
        r = c.post("/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    # Authorization: Bearer works too
    auth_token = anthropic.Anthropic(
        base_url=policy.url, auth_token=CLIENT_KEY, max_retries=0, http_client=httpx2.Client(trust_env=False)
    )
    assert auth_token.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]).usage


# ---------------------------------------------------------------------------------------------- one pipeline
def test_mixed_shapes_one_session_judged_and_leased(tiny_model_dir: Path, engine, tmp_path_factory):
    """A Responses forced call, its tool result sent back through Anthropic Messages, then a chat turn: one
    session, recorded, paired, judged and leased as training samples like any chat session."""
    sid = "mixed-shapes"
    with judged_policy_stack(tiny_model_dir, engine.url, tmp_path_factory.mktemp("mixed")) as (pol, _judge):
        first = _forced_weather(oai(pol, sid), "weather in Oslo?")
        call = next(o for o in first.output if o.type == "function_call")
        convo = [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": call.call_id, "name": call.name, "input": json.loads(call.arguments)}
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.call_id, "content": "sunny"}]},
        ]
        second = claude(pol, sid).messages.create(model=MODEL, max_tokens=6, messages=convo)
        text = "".join(b.text for b in second.content if b.type == "text")
        with client(pol.url) as c:
            messages = [
                {"role": "user", "content": "weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "thanks, that worked"},
            ]
            r = c.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 2},
                headers={"X-Session-Id": sid, "X-Session-Done": "true"},
            )
            assert r.status_code == 200, r.text
        check_paired_call(pol, sid, "sunny")
        st = store(pol)
        assert st.get_turn(sid, 1).pairing == "paired", st.get_turn(sid, 1).pairing_note

        got: dict[int, dict] = {}
        for _ in range(600):  # the judge works asynchronously; its samples become ready one by one
            got.update(of_session(lease_all(pol.url)["samples"], sid))
            if 0 in got and 1 in got:
                break
            time.sleep(0.1)
        assert 0 in got and 1 in got, f"samples of the mixed session: {sorted(got)}"
        s0 = got[0]
        assert s0["prompt_ids"] == st.get_turn(sid, 0).prompt_ids and s0["response_ids"]
        assert len(s0["response_ids"]) == len(s0["rollout_logprobs"]) and s0["constrained"] is True


# ---------------------------------------------------------------------------------------------- OpenAI surface
def test_models_by_id_aliases_and_unknown_model(policy):
    import anthropic

    c = oai(policy)
    listed = c.models.list().data
    assert [m.id for m in listed] == [MODEL, "m"] and all(m.created > 1_600_000_000 for m in listed)
    assert c.models.retrieve(MODEL).id == MODEL and c.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError) as gone:
        c.models.retrieve("gpt-nope")
    assert gone.value.code == "model_not_found"
    for call in (
        lambda: c.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}], max_tokens=1),
        lambda: c.responses.create(model="gpt-nope", input="x", max_output_tokens=1),
    ):
        with pytest.raises(openai.NotFoundError) as unknown:
            call()
        assert unknown.value.code == "model_not_found" and repr(MODEL) in unknown.value.message
    with pytest.raises(anthropic.NotFoundError) as claude_unknown:
        claude(policy).messages.create(model="claude-x", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert claude_unknown.value.body["error"]["type"] == "not_found_error"
    # The alias is served like the served name, and echoed as the client sent it.
    assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1).model == "m"


def test_stream_options_need_stream_and_continuous_usage(policy):
    c = oai(policy)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="stream_options.nope"):
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, stream=True, stream_options={"nope": True})
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(ch.usage is not None for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens}


# ---------------------------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize(
    ("path", "extra", "marker"),
    [
        ("/v1/responses", {"input": "tell me a story", "max_output_tokens": 3500}, "response.output_text.delta"),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 3500},
            "content_block_delta",
        ),
    ],
)
def test_stream_hang_up_aborts_the_engine_and_records_nothing(policy, engine, path, extra, marker):
    """A client that leaves a Responses or Messages stream is the chat turn's client leaving: the engine work is
    aborted and nothing of the undelivered reply is recorded or stored."""
    sid = f"hang-up-{path.rsplit('/', 1)[-1]}"
    seen = 0
    with client(policy.url) as c:
        req = {"model": MODEL, "temperature": 0, "stream": True, **extra}
        with c.stream("POST", path, json=req, headers={"X-Session-Id": sid}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                seen += line == f"event: {marker}"
                if seen >= 4:
                    assert metric_value(engine.url, "sglang:num_running_reqs") == 1
                    break  # leaving the stream closes the connection mid-answer
    wait_until(
        lambda: metric_value(engine.url, "sglang:num_running_reqs") == 0,
        timeout_s=5,
        interval_s=0.05,
        message="the engine kept generating for a client that left",
    )
    assert store(policy).get_turn(sid, 0) is None, "an undelivered reply was recorded"
