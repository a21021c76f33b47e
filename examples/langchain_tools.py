"""langchain-openai against Hindsight: a forced typed tool call and json_schema structured output.

HINDSIGHT_URL=http://127.0.0.1:30000 HINDSIGHT_API_KEY=... python examples/langchain_tools.py
"""

from __future__ import annotations

import os
import uuid
from typing import Literal

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel


@tool
def lookup(ids: list[int], exact: bool) -> str:
    """Look records up by id."""
    return "ok"


class Grade(BaseModel):
    passed: bool
    points: int
    level: Literal["low", "mid", "high"]


def main() -> None:
    session = f"lc-{uuid.uuid4().hex}"
    llm = ChatOpenAI(
        model="hindsight-policy",
        base_url=os.environ["HINDSIGHT_URL"] + "/v1",
        api_key=os.environ["HINDSIGHT_API_KEY"],
        max_tokens=200,
        http_client=httpx.Client(trust_env=False),
        http_async_client=httpx.AsyncClient(trust_env=False),
        default_headers={"X-Session-Id": session, "X-Session-Done": "true"},
    )
    msg = llm.bind_tools([lookup], tool_choice="lookup").invoke("find records 1 and 2")
    print("tool calls:", msg.tool_calls)
    side = llm.bind(extra_headers={"X-Turn-Type": "side"})  # not part of the recorded session
    print("structured:", side.with_structured_output(Grade, method="json_schema").invoke("grade this"))


if __name__ == "__main__":
    main()
