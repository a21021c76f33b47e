"""Forced tool calls never vanish (real policy server in front of the real dev engine, constrained by xgrammar).

Contract (policy_server.serving.tool_choice, engine.chat): with ``tool_choice`` required or named, a client's
``stop`` never cuts the call's markup (it applies after the call, and a forced reply has nothing after it),
so the reply is a call with ``finish_reason: tool_calls``, streamed or not. The grammar and parser halves
(strings that cannot spell markup, calls parsed by their structure) are unit-tested in test_guard_units.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import client, start_policy

pytestmark = pytest.mark.e2e

TOOLS = [
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"mode": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
                "required": ["mode"],
            },
        },
    },
]
MSGS = [{"role": "user", "content": "call a tool"}]


@pytest.fixture(scope="module")
def policy(
    tiny_model_dir: Path, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    d = tmp_path_factory.mktemp("forced-policy")
    mp = start_policy(tiny_model_dir, engine.url, d / "data", d)
    yield mp
    mp.stop()


def _stream_calls(c, body: dict) -> tuple[list[dict], str | None, str]:
    calls, finish, content = [], None, ""
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                calls += ch["delta"].get("tool_calls") or []
                content += ch["delta"].get("content") or ""
                finish = ch["finish_reason"] or finish
    return calls, finish, content


@pytest.mark.parametrize("stop", [["a"], ["</tool_call>"], ["\n", "{", "}", '"']], ids=["a", "close-tag", "json"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "pick"}}], ids=["required", "named"]
)
def test_forced_call_with_a_stop_inside_its_markup_still_returns_the_call(policy, stop, choice):
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": choice, "stop": stop, "max_tokens": 64, "seed": 3}
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text[:300]
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        [call] = out["message"]["tool_calls"]
        assert out["message"]["content"] in (None, "")
        args = json.loads(call["function"]["arguments"])
        if isinstance(choice, dict):
            assert call["function"]["name"] == "pick" and args["mode"] in ("a", "b")
        calls, finish, content = _stream_calls(c, body)
        assert finish == "tool_calls" and len(calls) == 1 and content == ""
