"""End-to-end with the real agent clients users run: openai-agents (Runner.run / run_streamed with a typed
``@function_tool``), langchain-openai (``bind_tools`` with a forced tool, ``with_structured_output``) and
litellm (a forced typed call with a session header) against the real policy server -> sglang-router -> dev engine.

Contract (CONTRACTS.md "Forced tool calls", "OpenAI fields", docs/CLIENTS.md): a forced call of a tool
with ``list[str]``, ``Optional[int]``, ``Literal`` and ``bool`` parameters arrives typed, so the SDK runs
the tool (it fails with "An error occurred while running the tool" when arguments come back as strings);
a per-run ``X-Session-Id`` records every model call of the run, and ending the session with one side
request afterwards (not ``X-Session-Done`` in ``ModelSettings.extra_headers``, which would close the
tool-call turn early) pairs the tool-call turn with its tool result.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

import httpx
import pydantic
import pytest

from policy_server.store import Store
from tests.testkit.servers import CLIENT_KEY, async_openai_client, policy_data_dir

if TYPE_CHECKING:
    from agents import Agent
    from langchain_openai import ChatOpenAI

# openai-agents and LangChain are imported by the tests that run them, not at collection: their imports cost every
# pytest-xdist worker seconds of CPU, whether it runs this file or not.
pytestmark = pytest.mark.e2e

# Bounded strings: the tiny test model is random and rarely closes an unbounded string in time.
Short = Annotated[str, pydantic.Field(max_length=8)]


data_dir = policy_data_dir


def typed_agent(policy, calls: list[dict], sid: str) -> Agent:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise try to export traces to api.openai.com
    model = OpenAIChatCompletionsModel(model="hindsight-policy", openai_client=async_openai_client(policy.url))

    @function_tool
    def place_order(items: list[Short], limit: int | None, mode: Literal["fast", "safe"], urgent: bool) -> str:
        """Place an order.

        Args:
            items: what to order
            limit: optional cap
            mode: shipping mode
            urgent: rush it
        """
        calls.append({"items": items, "limit": limit, "mode": mode, "urgent": urgent})
        return "order placed"

    return Agent(
        name="shop",
        instructions="Use the tool.",
        tools=[place_order],
        model=model,
        model_settings=ModelSettings(
            tool_choice="place_order", max_tokens=300, temperature=1.0, extra_headers={"X-Session-Id": sid}
        ),
    )


def end_session(policy, sid: str) -> None:
    """How an agent run ends its session: one side request with X-Session-Done (docs/CLIENTS.md)."""
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(
            policy.url + "/v1/chat/completions",
            headers={
                "Authorization": f"Bearer {CLIENT_KEY}",
                "X-Session-Id": sid,
                "X-Turn-Type": "side",
                "X-Session-Done": "true",
            },
            json={"messages": [{"role": "user", "content": "end"}], "max_tokens": 1},
        )
    assert r.status_code == 200, r.text


def check_typed(calls: list[dict]) -> None:
    assert calls, "the SDK never ran the tool (arguments did not validate)"
    c = calls[0]
    assert isinstance(c["items"], list) and all(isinstance(i, str) and len(i) <= 8 for i in c["items"])
    assert c["limit"] is None or isinstance(c["limit"], int)
    assert c["mode"] in ("fast", "safe") and isinstance(c["urgent"], bool)


def check_recorded_and_paired(policy, sid: str) -> None:
    st = Store(data_dir(policy))
    first = st.get_turn(sid, 0)
    assert first.response["tool_calls"] and first.constrained is True
    assert first.pairing == "paired", first.pairing_note
    assert [m["role"] for m in first.next_state] == ["tool"]
    assert first.next_state[0]["content"] == "order placed"
    assert st.get_turn(sid, 1) is not None  # the answer after the tool result, ended by the side request


def test_openai_agents_runner_typed_tool_and_session(policy):
    from agents import Runner

    calls: list[dict] = []
    result = Runner.run_sync(typed_agent(policy, calls, "agents-run"), "order two widgets", max_turns=3)
    check_typed(calls)
    assert isinstance(result.final_output, str)
    end_session(policy, "agents-run")
    check_recorded_and_paired(policy, "agents-run")


def test_openai_agents_run_streamed(policy):
    from agents import Runner

    calls: list[dict] = []

    async def run() -> None:
        streamed = Runner.run_streamed(typed_agent(policy, calls, "agents-stream"), "order", max_turns=3)
        async for _ in streamed.stream_events():
            pass

    asyncio.run(run())
    check_typed(calls)
    end_session(policy, "agents-stream")
    check_recorded_and_paired(policy, "agents-stream")


def lc_model(policy, **kw) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="hindsight-policy",
        base_url=policy.url + "/v1",
        api_key=CLIENT_KEY,
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(trust_env=False),
        http_async_client=httpx.AsyncClient(trust_env=False),
        **kw,
    )


def lookup_tool() -> Any:
    """A LangChain tool with typed parameters (``@tool``)."""
    from langchain_core.tools import tool

    @tool
    def lookup(ids: list[int], note: Short | None, exact: bool) -> str:
        """Look records up by id."""
        return "ok"

    return lookup


def test_langchain_bind_tools_forced_call_is_typed(policy):
    llm = lc_model(policy, max_tokens=300, default_headers={"X-Session-Id": "lc-tools", "X-Session-Done": "1"})
    msg = llm.bind_tools([lookup_tool()], tool_choice="lookup").invoke("find records 1 and 2")
    [call] = msg.tool_calls
    assert call["name"] == "lookup"
    args = call["args"]
    assert isinstance(args["ids"], list) and all(isinstance(i, int) for i in args["ids"])
    assert isinstance(args["exact"], bool) and (args["note"] is None or isinstance(args["note"], str))
    assert Store(data_dir(policy)).get_turn("lc-tools", 0).constrained is True


class Grade(pydantic.BaseModel):
    passed: bool
    points: int
    level: Literal["low", "mid", "high"]


def test_langchain_structured_output_json_schema(policy):
    llm = lc_model(policy, max_tokens=200)
    out = llm.with_structured_output(Grade, method="json_schema").invoke("grade this")
    assert isinstance(out, Grade)


def test_litellm_forced_tool_call_and_session(policy, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the model price list
    import litellm

    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                        "exact": {"type": "boolean"},
                    },
                    "required": ["ids", "exact"],
                },
            },
        }
    ]
    r = litellm.completion(
        model="openai/hindsight-policy",
        api_base=policy.url + "/v1",
        api_key=CLIENT_KEY,
        messages=[{"role": "user", "content": "find 1 and 2"}],
        tools=tools,
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        num_retries=0,
        extra_headers={"X-Session-Id": "litellm", "X-Session-Done": "true"},
    )
    [call] = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert all(isinstance(i, int) for i in args["ids"]) and isinstance(args["exact"], bool)
    assert Store(data_dir(policy)).get_turn("litellm", 0).constrained is True
