"""Rendering of judge prompts: conversation context trimmed to a token budget, judged content delimited.

Contract:
- ``render_judge_messages(template, context, response, next_state, counter, context_budget_tokens,
  part_budget_tokens)`` returns ``(messages, info)``: the chat messages for the judge (system + user) and
  what was trimmed.
- Context: messages are shown oldest first as ``[role] text`` blocks; when they exceed
  ``context_budget_tokens`` the OLDEST are dropped first, and if the newest alone is too long its head is
  cut (its end, nearest to the judged step, is kept). A note says how many turns were dropped.
- The judged response and the next state are each capped at ``part_budget_tokens`` (head and tail kept,
  the middle replaced by an explicit omission marker), so one huge tool output cannot crowd out the rest.
- Token counts use the judge tokenizer when one is configured (``TokenCounter.from_tokenizer``), else a
  documented estimate of ceil(chars / 4) (``TokenCounter.estimate``), which over-counts English slightly.
- Delimiting: every piece of judged text passes through :func:`neutralise`, which escapes the sequences a
  judge verdict is parsed from (``\\boxed`` -> ``[boxed]``, ``[HINT_START]``/``[HINT_END]`` -> ``(HINT_START)``/
  ``(HINT_END)``), our block markers (``<<<``/``>>>``) and think tags; the prompt says judged blocks are data,
  not instructions. Injected "ignore previous instructions" stays visible to the judge as data.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prompts.templates import PromptTemplate

_NEUTRALISE = [
    (re.compile(r"\\boxed", re.IGNORECASE), "[boxed]"),
    (re.compile(r"\[\s*HINT_START\s*\]", re.IGNORECASE), "(HINT_START)"),
    (re.compile(r"\[\s*HINT_END\s*\]", re.IGNORECASE), "(HINT_END)"),
    (re.compile(r"<<<"), "<< <"),
    (re.compile(r">>>"), "> >>"),
    (re.compile(r"<(/?)think>", re.IGNORECASE), r"(\1think)"),
]


def neutralise(text: str) -> str:
    """Escape verdict/hint/marker syntax inside judged text so only the judge can produce it."""
    for pattern, repl in _NEUTRALISE:
        text = pattern.sub(repl, text)
    return text


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens with the judge tokenizer, or estimates ceil(chars/4) when there is none."""

    count: Callable[[str], int]
    exact: bool

    @classmethod
    def estimate(cls) -> TokenCounter:
        return cls(count=lambda s: math.ceil(len(s) / 4), exact=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenCounter:
        return cls(count=lambda s: len(tokenizer.encode(s, add_special_tokens=False)), exact=True)


@dataclass
class RenderInfo:
    context_messages_total: int = 0
    context_messages_dropped: int = 0
    context_tokens: int = 0
    truncated_parts: list[str] = field(default_factory=list)


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _format_tool_calls(tool_calls: list[dict[str, Any]] | None) -> str:
    lines = []
    for call in tool_calls or []:
        fn = call.get("function", call)
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        lines.append(f"[tool call] {fn.get('name', '?')}({args})")
    return "\n".join(lines)


def format_message(msg: dict[str, Any]) -> str:
    """One message as ``[role] text`` (tool calls of assistant messages appended)."""
    body = _text_of(msg.get("content"))
    calls = _format_tool_calls(msg.get("tool_calls"))
    text = "\n".join(x for x in (body, calls) if x)
    return f"[{msg.get('role', '?')}] {neutralise(text)}"


def _cap_head_tail(text: str, budget_tokens: int, counter: TokenCounter) -> tuple[str, bool]:
    if counter.count(text) <= budget_tokens:
        return text, False
    # chars/4 is a safe first guess for both counters; shrink until it fits.
    keep_chars = max(16, budget_tokens * 4)
    while True:
        half = keep_chars // 2
        omitted = len(text) - 2 * half
        out = f"{text[:half]}\n[... {omitted} characters omitted ...]\n{text[-half:]}"
        if counter.count(out) <= budget_tokens or keep_chars <= 16:
            return out, True
        keep_chars = int(keep_chars * 0.8)


def _cap_tail(text: str, budget_tokens: int, counter: TokenCounter) -> str:
    keep_chars = max(16, budget_tokens * 4)
    while True:
        out = f"[... start cut ...] {text[-keep_chars:]}"
        if counter.count(out) <= budget_tokens or keep_chars <= 16:
            return out
        keep_chars = int(keep_chars * 0.8)


def trim_context(context: list[dict[str, Any]], counter: TokenCounter, budget_tokens: int) -> tuple[str, RenderInfo]:
    """Newest-last context blocks within ``budget_tokens``; oldest dropped first."""
    info = RenderInfo(context_messages_total=len(context))
    blocks = [format_message(m) for m in context]
    kept: list[str] = []
    used = 0
    for block in reversed(blocks):
        cost = counter.count(block) + 1
        if used + cost > budget_tokens:
            if not kept and budget_tokens > 0:  # the newest message alone is too long: keep its end
                kept.append(_cap_tail(block, budget_tokens, counter))
                used = counter.count(kept[0])
            break
        kept.append(block)
        used += cost
    kept.reverse()
    info.context_messages_dropped = len(blocks) - len(kept)
    info.context_tokens = used
    lines = []
    if info.context_messages_dropped:
        lines.append(f"({info.context_messages_dropped} older message(s) omitted for length)")
    lines.extend(kept)
    return ("\n\n".join(lines) if lines else "(no earlier conversation)"), info


def format_response(response: dict[str, Any], include_reasoning: bool) -> str:
    parts = []
    if include_reasoning and response.get("reasoning_content"):
        parts.append(f"[assistant reasoning] {neutralise(_text_of(response['reasoning_content']))}")
    content = _text_of(response.get("content"))
    if content:
        parts.append(f"[assistant] {neutralise(content)}")
    calls = _format_tool_calls(response.get("tool_calls"))
    if calls:
        parts.append(neutralise(calls))
    return "\n".join(parts) if parts else "[assistant] (empty)"


def render_judge_messages(
    template: PromptTemplate,
    *,
    context: list[dict[str, Any]],
    response: dict[str, Any],
    next_state: list[dict[str, Any]],
    counter: TokenCounter,
    context_budget_tokens: int,
    part_budget_tokens: int,
    include_reasoning: bool = False,
) -> tuple[list[dict[str, str]], RenderInfo]:
    """System + user messages of a judge prompt; see the module docstring for trimming and delimiting."""
    context_text, info = trim_context(context, counter, context_budget_tokens)
    response_text, cut = _cap_head_tail(format_response(response, include_reasoning), part_budget_tokens, counter)
    if cut:
        info.truncated_parts.append("response")
    next_text, cut = _cap_head_tail("\n\n".join(format_message(m) for m in next_state), part_budget_tokens, counter)
    if cut:
        info.truncated_parts.append("next_state")
    messages = template.render_messages(context=context_text, response=response_text, next_state=next_text)
    return messages, info


def render_plain_text(messages: list[dict[str, str]]) -> str:
    """Fallback rendering when no judge tokenizer is available: the engine gets ``text``, sections labelled."""
    return "\n\n".join(f"### {m['role']}\n{m['content']}" for m in messages) + "\n\n### assistant\n"
