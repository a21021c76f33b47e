"""What a chat template writes after an assistant reply, whatever it does to the history before it.

Role: ``history=sampled`` over a template that rewrites history (engine.continuation): the earlier turns stay
exactly as sent and sampled, and only the text the template writes after the reply (its closing, the new
messages, the generation prompt) is rendered. Contract of :func:`after_reply`: the template renders the real
system message, stand-ins for the last messages before the reply (:func:`recent_head`), the reply with a marker
for its content and its calls' arguments, and the real new messages with the generation prompt; the text is
cut after the last marker, then at the template's closing of an assistant message (learned from the same head
with a marked reply last). Where that closing does not follow the marker (a call closed by other markup,
gpt-oss's ``<|call|>``), the marked arguments' JSON closers are skipped. The work depends on the new messages
and the system message only, never on the history's length.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Stands in for the reply's content (and its calls' arguments); never in real text by accident.
REPLY_MARK = "HSREPLYMARKQ7Z"
Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> the template's text


def stand_in_calls(calls: list[dict[str, Any]], arguments: str = "{}") -> list[dict[str, Any]]:
    """Stand-ins of a reply's tool calls: their ids and names kept (templates match results to calls by id)."""
    return [
        {
            "id": tc.get("id") or f"call_{i}",
            "type": "function",
            "function": {"name": (tc.get("function") or {}).get("name") or "f", "arguments": arguments},
        }
        for i, tc in enumerate(calls)
    ]


def recent_head(messages: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The history the reply's stand-in follows: the real system message (templates may move it next to the
    new messages: Mistral's), then stand-ins of the last message before the reply that is not a tool result
    and the tool results after it (a template's rendering of the new messages may depend on them:
    DeepSeek-R1's), opened by a user message. Short, whatever the history's length."""
    head: list[dict[str, Any]] = []
    start = 0
    if messages and messages[0].get("role") in ("system", "developer"):
        head.append(messages[0])
        start = 1
    at = n - 1
    while at > start and messages[at].get("role") == "tool":
        at -= 1
    if at < start or messages[at].get("role") != "user":
        head.append({"role": "user", "content": "U"})
    for m in messages[max(at, start) : n]:
        stand_in: dict[str, Any] = {"role": m.get("role"), "content": "T" if m.get("role") == "tool" else "U"}
        for key in ("tool_call_id", "name"):
            if key in m:
                stand_in[key] = m[key]
        if m.get("tool_calls"):
            stand_in["tool_calls"] = stand_in_calls(m["tool_calls"])
        head.append(stand_in)
    return head


def after_reply(render: Render, messages: list[dict[str, Any]], n: int) -> str | None:
    """The text after the reply ``messages[n]`` up to the end of the generation prompt (module docstring), or
    None when the template dropped the marker. Template refusals propagate."""
    head = recent_head(messages, n)
    real = messages[n]
    reply: dict[str, Any] = {"role": "assistant", "content": REPLY_MARK}
    if real.get("tool_calls"):
        reply["tool_calls"] = stand_in_calls(real["tool_calls"], json.dumps({"m": REPLY_MARK}))
    plain = render([*head, {"role": "assistant", "content": REPLY_MARK}], False)
    full = render([*head, reply, *messages[n + 1 :]], True)
    if (at := full.rfind(REPLY_MARK)) < 0 or REPLY_MARK not in plain:
        return None
    close = plain[plain.rfind(REPLY_MARK) + len(REPLY_MARK) :]
    tail = full[at + len(REPLY_MARK) :]
    cut = tail.find(close) if close.strip() else -1
    return tail[cut:] if cut >= 0 else tail.lstrip('"}]')
