"""A prompt's size, measured without rendering it: its characters, a floor of its tokens, the model's context.

Role: the cheap answers the generation path needs before it renders a prompt (policy_server.serving.generation):
whether a prompt is short enough to render on the event loop (:func:`prompt_chars`), whether it cannot fit the
engine's context at all (:func:`prompt_token_floor`, with the vocabulary's longest entry,
:func:`longest_token_chars`), and what that context is (:func:`context_length`, from the model's config.json).
Each is one pass over the values, without copies; nothing here renders or tokenizes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def prompt_chars(messages: list[dict[str, object]], tools: list[dict[str, object]] | None, enough: int) -> int:
    """About how many characters the prompt renders to (the strings it holds), counting stopped once past
    ``enough``: a long tool description or text part counts at its real length."""
    n = string_chars(tools) if tools else 0
    for m in messages:
        n += string_chars(m.get("content")) + string_chars(m.get("tool_calls")) + 16
        if n > enough:
            break
    return n


def string_chars(value: object) -> int:
    """Characters of every string (keys included) in a JSON value; iterative, so any nesting is safe."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            total += sum(len(k) for k in node if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


def prompt_token_floor(
    messages: list[dict[str, object]], max_token_chars: int, tools: Sequence[object] | None = None
) -> int:
    """A lower bound of the rendered prompt's length in tokens, without rendering it: every message adds at
    least one token, and no token covers more than ``max_token_chars`` characters of its text.

    Counted: message text (string content, text parts), the names and arguments of history tool calls,
    and every string of the tool definitions (templates render each tool whole, as JSON, whose escaping
    only lengthens it). Cost: one pass over the values, no copies."""
    chars = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            chars += sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for tc in calls:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict):
                    chars += string_chars([fn.get("name"), fn.get("arguments")])
    if isinstance(tools, list):
        chars += string_chars(tools)
    return len(messages) + chars // max(1, max_token_chars)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters any vocabulary entry spells (byte-level BPE: one character per byte)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def context_length(model_path: str) -> int | None:
    """``max_position_embeddings`` of the model's config.json, or None when the folder does not say."""
    try:
        with open(Path(model_path) / "config.json", encoding="utf-8") as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
