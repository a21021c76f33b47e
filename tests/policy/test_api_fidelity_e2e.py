"""End-to-end, with the real ``openai`` and ``anthropic`` SDKs against the dev stack (policy server ->
sglang-router -> dev engine): what each API shape promises its clients beyond the happy path.

Contract (docs/CLIENTS.md "OpenAI Responses and Anthropic Messages"):

- A Responses chain (``previous_response_id``) is one conversation for pairing whether a follow-up repeats,
  omits or changes the first request's ``instructions``; the model sees each request's own instructions only
  (OpenAI's rule), and the recorded prompt is exactly what it saw.
- Structured output (chat ``response_format``, Responses ``text.format``) is JSON that parses, streamed or not,
  whatever the random tiny model samples inside ``maxLength``-bounded strings.
- An empty tool name (a tool definition or a call in the history) is a 400 naming the field, in the route's
  own error shape.
- ``POST /v1/messages/count_tokens`` counts the rendered request; every Messages route error is in
  Anthropic's error shape, so the anthropic SDK raises the right class with the server's message.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Annotated

import httpx2
import openai
import pydantic
import pytest

from engine.chat import load_tokenizer, render_prompt_ids
from policy_server.store import Store
from tests.testkit.servers import CLIENT_KEY, openai_client

if TYPE_CHECKING:
    import anthropic

pytestmark = pytest.mark.e2e

MODEL = "hindsight-policy"


def oai(policy, sid: str | None = None) -> openai.OpenAI:
    return openai_client(policy.url, timeout_s=120, headers={"X-Session-Id": sid} if sid else None)


def claude(policy) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(
        base_url=policy.url,
        api_key=CLIENT_KEY,
        max_retries=0,
        timeout=120,
        http_client=httpx2.Client(trust_env=False),  # the anthropic SDK runs on httpx2
    )


def store(policy) -> Store:
    return Store(policy.log_path.parent / "data")


# ---------------------------------------------------------------------------------- Responses instructions
def _system(text: str | None) -> list[dict]:
    return [] if text is None else [{"role": "system", "content": text}]


@pytest.mark.parametrize(
    "first_instructions, follow_up",
    [
        ("Be brief.", None),
        ("Be brief.", "Be brief."),
        ("Be brief.", "Answer in French."),
        (None, "Be brief."),
    ],
    ids=["omitted", "repeated", "changed", "added"],
)
def test_responses_chain_with_instructions_pairs_its_first_turn(
    policy, tiny_model_dir, first_instructions: str | None, follow_up: str | None
):
    sid = f"chain-{uuid.uuid4().hex[:8]}"
    c = oai(policy, sid)

    def instructions(text: str | None) -> dict:
        return {} if text is None else {"instructions": text}

    r1 = c.responses.create(
        model=MODEL, input="Hi, I am John.", max_output_tokens=8, **instructions(first_instructions)
    )
    r2 = c.responses.create(
        model=MODEL,
        input="I am Mark.",
        previous_response_id=r1.id,
        max_output_tokens=8,
        extra_headers={"X-Session-Done": "true"},
        **instructions(follow_up),
    )
    assert r2.model_extra and r2.model_extra["hindsight"]["session_id"] == sid  # one session, not S~...
    db = store(policy)
    first, second = db.get_turn(sid, 0), db.get_turn(sid, 1)
    assert first is not None and second is not None
    assert first.pairing == "paired", first.pairing_note
    assert first.next_state == [{"role": "user", "content": "I am Mark."}]
    # The model saw each request's own instructions, nothing carried over (OpenAI's rule).
    assert [m for m in first.messages if m["role"] == "system"] == _system(first_instructions)
    assert [m for m in second.messages if m["role"] == "system"] == _system(follow_up)
    assert [m["role"] for m in second.messages if m["role"] != "system"] == ["user", "assistant", "user"]
    if follow_up == first_instructions:  # the same instructions: the prompt continues the first turn's exact tokens
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == (
            first.prompt_ids + first.response_ids
        )
    else:  # other instructions: the prompt is the render of what this request asked for, nothing of the first's
        assert second.prompt_ids == render_prompt_ids(load_tokenizer(str(tiny_model_dir)), second.messages)


def test_responses_chain_without_session_header_keeps_its_session_across_instructions(policy):
    """The chain itself names the session (the previous_response rule) and pairs the same way."""
    c = oai(policy)
    r1 = c.responses.create(model=MODEL, instructions="Be brief.", input="Hi, I am Ann.", max_output_tokens=8)
    sid = r1.model_extra["hindsight"]["session_id"]  # type: ignore[index]
    r2 = c.responses.create(model=MODEL, input="I am Bo.", previous_response_id=r1.id, max_output_tokens=8)
    assert r2.model_extra["hindsight"]["session_id"] == sid  # type: ignore[index]
    first = store(policy).get_turn(sid, 0)
    assert first is not None and first.pairing == "paired", first and first.pairing_note
    assert first.next_state == [{"role": "user", "content": "I am Bo."}]


# ---------------------------------------------------------------------------------- structured output
class Card(pydantic.BaseModel):
    """Bounded strings: the random tiny model fills them with whatever it samples, control characters included."""

    name: Annotated[str, pydantic.Field(max_length=12)]
    score: Annotated[str, pydantic.Field(max_length=8)]
    note: Annotated[str, pydantic.Field(max_length=10)]


TRIES = 8


def test_chat_structured_output_parses_on_every_seed(policy):
    c = oai(policy)
    for seed in range(TRIES):
        done = c.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "card"}], max_tokens=200, seed=seed, response_format=Card
        )
        assert isinstance(done.choices[0].message.parsed, Card), (seed, done.choices[0].message.content)
    for seed in range(TRIES // 2):
        with c.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "card"}], max_tokens=200, seed=seed, response_format=Card
        ) as stream:
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, Card), (seed, final.choices[0].message.content)


def test_responses_structured_output_parses_every_time(policy):
    c = oai(policy)
    for _ in range(TRIES):
        done = c.responses.parse(model=MODEL, input="card", text_format=Card, max_output_tokens=200)
        assert isinstance(done.output_parsed, Card), done.output_text
    for _ in range(TRIES // 2):
        with c.responses.stream(model=MODEL, input="card", text_format=Card, max_output_tokens=200) as stream:
            final = stream.get_final_response()
        assert isinstance(final.output_parsed, Card), final.output_text


# ---------------------------------------------------------------------------------- empty tool names
def _call(name: str) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": [_call("")]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"},
                ]
            },
            "messages.1.tool_calls.0.function.name",
        ),
    ],
    ids=["tool", "history_call"],
)
def test_chat_empty_tool_name_is_a_400_naming_the_field(policy, body: dict, field: str):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as exc:
        oai(policy).chat.completions.create(**request)
    assert field in exc.value.message and exc.value.body["param"] == field  # type: ignore[index]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": "x", "tools": [{"type": "function", "name": "", "parameters": {}}]}, "tools[0].name"),
        (
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "function_call", "call_id": "c1", "name": "", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "r"},
                ]
            },
            "input[1].name",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": ""},
            },
            "tool_choice.name",
        ),
    ],
    ids=["tool", "history_call", "tool_choice"],
)
def test_responses_empty_tool_name_is_a_400_naming_the_field(policy, body: dict, field: str):
    with pytest.raises(openai.BadRequestError) as exc:
        oai(policy).responses.create(model=MODEL, max_output_tokens=2, **body)
    assert field in exc.value.message and exc.value.body["param"] == field  # type: ignore[index]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]},
                ]
            },
            "messages[1].content[0].name",
        ),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": ""}},
            "tool_choice.name",
        ),
    ],
    ids=["tool", "history_tool_use", "tool_choice"],
)
def test_messages_empty_tool_name_is_a_400_in_anthropics_shape(policy, body: dict, field: str):
    import anthropic

    request = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude(policy).messages.create(**request)
    assert field in exc.value.message
    assert exc.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"{field} must be a non-empty string"},
    }


# ---------------------------------------------------------------------------------- Messages: count_tokens, errors
WEATHER = {
    "name": "weather",
    "description": "Weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_LOOP = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
]


@pytest.mark.parametrize(
    "prompt",
    [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"messages": TOOL_LOOP, "system": "Be brief.", "tools": [WEATHER]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "thinking": {"type": "disabled"}},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": {"type": "any"}},
    ],
    ids=["text", "system_and_tool_loop", "tools_thinking_off", "forced_call"],
)
def test_count_tokens_is_what_the_message_prefills(policy, prompt: dict):
    """The anthropic SDK's ``messages.count_tokens`` counts exactly the prompt ``messages.create`` prefills (its
    ``usage.input_tokens``), tools, system and the thinking switch included."""
    c = claude(policy)
    counted = c.messages.count_tokens(model=MODEL, **prompt)
    created = c.messages.create(model=MODEL, max_tokens=1, **prompt)
    assert counted.input_tokens == created.usage.input_tokens > 0
    if prompt.get("tools"):
        bare = c.messages.count_tokens(model=MODEL, messages=prompt["messages"])
        assert bare.input_tokens < counted.input_tokens  # the tool definitions are in the prompt


def test_messages_routes_answer_every_error_in_anthropics_shape(policy):
    import anthropic

    c = claude(policy)
    msgs = [{"role": "user", "content": "x"}]

    def shaped(exc: anthropic.APIStatusError, kind: str, text: str) -> None:
        assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body  # type: ignore[index]
        assert text in exc.body["error"]["message"] and text in exc.message  # type: ignore[index]

    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.count_tokens(model=MODEL, messages=msgs, extra_body={"max_tokens": 3})
    shaped(bad.value, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as empty:
        c.messages.count_tokens(model=MODEL, messages=[])
    shaped(empty.value, "invalid_request_error", "messages")
    with pytest.raises(anthropic.AuthenticationError) as auth:
        claude(policy).with_options(api_key="wrong").messages.count_tokens(model=MODEL, messages=msgs)
    shaped(auth.value, "authentication_error", "")
    with pytest.raises(anthropic.NotFoundError) as model:
        c.messages.count_tokens(model="claude-x", messages=msgs)
    shaped(model.value, "not_found_error", "claude-x")
    with pytest.raises(anthropic.NotFoundError) as route:
        c.messages.batches.list()  # a Messages path the server does not serve
    shaped(route.value, "not_found_error", "Not Found")
    with pytest.raises(anthropic.APIStatusError) as large:  # the body limit answers before any route runs
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x" * 70_000}])
    assert large.value.status_code == 413
    shaped(large.value, "request_too_large", "")
