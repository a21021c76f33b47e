"""The dev engine's own ``/v1/chat/completions`` rejects what SGLang rejects and constrains forced calls.

Real dev engine subprocess (module fixture), HTTP on loopback. Contract: devkit.dev_server.openai_chat.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

U = {"role": "user", "content": "call a tool"}
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {"type": "object", "properties": {"mode": {"enum": ["a", "b"]}}, "required": ["mode"]},
    },
}


def _chat(engine, body: dict) -> httpx.Response:
    return httpx.post(engine.url + "/v1/chat/completions", json=body, trust_env=False, timeout=120)


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [U], "max_tokens": 0}, "max_tokens"),
        ({"messages": [U], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": [U], "tool_choice": "required"}, "Tools cannot be empty"),
        ({"messages": [U], "tool_choice": {"type": "function", "function": {"name": "pick"}}}, "Tools"),
        ({"messages": [U], "tools": [PICK], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        ({"messages": [U], "top_logprobs": 3}, "logprobs"),
        ({"messages": [U], "tools": [PICK], "tool_choice": "required", "regex": "a+"}, "forced tool_choice"),
    ],
    ids=[
        "role",
        "max-tokens-0",
        "max-completion-negative",
        "required-no-tools",
        "named-no-tools",
        "named-unknown",
        "top-logprobs-alone",
        "forced-plus-regex",
    ],
)
def test_rejected_as_sglang_rejects(engine, body, needle):
    r = _chat(engine, {**body, "max_tokens": body.get("max_tokens", 4)})
    assert r.status_code == 400, r.text[:300]
    err = r.json()
    assert err["object"] == "error" and needle in err["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
@pytest.mark.parametrize("stop", [None, ["a"], ["</tool_call>"]])
def test_forced_tool_choice_is_constrained_to_a_typed_call(engine, choice, stop):
    body = {"messages": [U], "tools": [PICK], "tool_choice": choice, "max_tokens": 64, "seed": 1}
    if stop:
        body["stop"] = stop
    r = _chat(engine, body)
    assert r.status_code == 200, r.text[:300]
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    [call] = out["message"]["tool_calls"]
    assert call["function"]["name"] == "pick"
    assert json.loads(call["function"]["arguments"])["mode"] in ("a", "b")
