"""An openai-agents run recorded as one Hindsight session, with a typed ``@function_tool``.

    HINDSIGHT_URL=http://127.0.0.1:30000 HINDSIGHT_API_KEY=... python examples/openai_agents_run.py

The session id goes in ``ModelSettings.extra_headers`` (one per run). ``X-Session-Done`` must NOT go there: it
would apply to every model call of the run and close the tool-call turn before its tool result arrives (the
sample is then rejected ``no_next_state``). End the session after the run with one side request instead
(or let the idle timeout end it).
"""

from __future__ import annotations

import os
import uuid
from typing import Annotated, Literal

import httpx
import openai
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from pydantic import Field


@function_tool
def place_order(
    items: list[Annotated[str, Field(max_length=16)]], limit: int | None, mode: Literal["fast", "safe"]
) -> str:
    """Place an order.

    Args:
        items: what to order
        limit: optional cap
        mode: shipping mode
    """
    return f"ordered {len(items)} item(s), {mode}"


def end_session(url: str, key: str, session_id: str) -> None:
    """A side turn with X-Session-Done ends the session; side turns are never recorded."""
    httpx.post(
        url + "/v1/chat/completions",
        trust_env=False,
        timeout=60,
        json={"messages": [{"role": "user", "content": "end"}], "max_tokens": 1},
        headers={
            "Authorization": f"Bearer {key}",
            "X-Session-Id": session_id,
            "X-Turn-Type": "side",
            "X-Session-Done": "true",
        },
    ).raise_for_status()


def main() -> None:
    url, key = os.environ["HINDSIGHT_URL"], os.environ["HINDSIGHT_API_KEY"]
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, http_client=httpx.AsyncClient(trust_env=False))
    session_id = f"agents-{uuid.uuid4().hex}"
    agent = Agent(
        name="shop",
        instructions="Use the tool.",
        tools=[place_order],
        model=OpenAIChatCompletionsModel(model="hindsight-policy", openai_client=client),
        model_settings=ModelSettings(
            tool_choice="place_order", max_tokens=256, extra_headers={"X-Session-Id": session_id}
        ),
    )
    result = Runner.run_sync(agent, "Order two widgets, fast.", max_turns=3)
    print("final output:", result.final_output)
    end_session(url, key, session_id)
    print("session", session_id, "ended")


if __name__ == "__main__":
    main()
