"""A recorded agent session with the official openai SDK: a forced, typed tool call, its result, an answer.

    HINDSIGHT_URL=http://127.0.0.1:30000 HINDSIGHT_API_KEY=... python examples/openai_sdk_chat.py

One ``X-Session-Id`` per conversation; the last request says ``X-Session-Done`` (docs/CLIENTS.md).
"""

from __future__ import annotations

import json
import os
import uuid

import httpx
import openai

# A self-contained example: its client set-up is the demo's and the tests' on purpose (copyable as it stands).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    }
]


def main() -> None:
    client = openai.OpenAI(
        base_url=os.environ["HINDSIGHT_URL"] + "/v1",
        api_key=os.environ["HINDSIGHT_API_KEY"],
        http_client=httpx.Client(trust_env=False),
    )
    session = {"X-Session-Id": f"sdk-{uuid.uuid4().hex}"}
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model="hindsight-policy",
        messages=messages,
        tools=TOOLS,
        max_tokens=128,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        logprobs=True,
        extra_headers=session,
    )
    msg = r.choices[0].message
    print("finish:", r.choices[0].finish_reason, "weights:", r.model_extra["hindsight"]["weight_version"])
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        args = json.loads(call.function.arguments)  # typed by the schema: days is an int
        print("tool call:", call.function.name, args)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"18C in {args['city']}"})
    if not msg.tool_calls:
        messages.append({"role": "user", "content": "Please use the tool."})
    r = client.chat.completions.create(
        model="hindsight-policy",
        messages=messages,
        tools=TOOLS,
        max_tokens=32,
        extra_headers={**session, "X-Session-Done": "true"},
    )
    print("answer:", r.choices[0].message.content)


if __name__ == "__main__":
    main()
