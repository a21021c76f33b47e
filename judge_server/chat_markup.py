"""Chat-template markup in reward-client text, read back into messages before judging.

Role: OpenRLHF's remote reward client sends ``query`` = the tokenizer's decode of prompt + generated ids
WITH special tokens, and its ``prompts`` are usually already rendered by the policy's chat template;
slime's ``prompt`` is the rendered string when it applies the template itself. Handed over as text, the
judge would read ``<|im_start|>user ...`` as part of what the user said. Here the common template
families are parsed back into messages (role and content per turn), and what is left of the markup is
stripped, so the judge sees the conversation the policy saw.

Families (recognised by their turn markers; the first that occurs wins):

- ChatML (Qwen, many others): ``<|im_start|>ROLE\\n...<|im_end|>``;
- Llama 3: ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n...<|eot_id|>``;
- Gemma: ``<start_of_turn>ROLE\\n...<end_of_turn>`` (role ``model`` is the assistant).

A final turn without its end marker is the open generation prompt (in a prompt) or the generated reply (in a
query). In an assistant turn a leading ``<think>...</think>`` block is the reply's reasoning. Text with no
turn marker is returned as is, less the end-of-text tokens (:func:`strip_markup`).
"""

from __future__ import annotations

import re
from typing import Any

_FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("<|im_start|>", re.compile(r"<\|im_start\|>([A-Za-z_]+)\n(.*?)(<\|im_end\|>|(?=<\|im_start\|>)|\Z)", re.S)),
    (
        "<|start_header_id|>",
        re.compile(
            r"<\|start_header_id\|>([A-Za-z_]+)<\|end_header_id\|>\n*(.*?)(<\|eot_id\|>|(?=<\|start_header_id\|>)|\Z)",
            re.S,
        ),
    ),
    ("<start_of_turn>", re.compile(r"<start_of_turn>([A-Za-z_]+)\n(.*?)(<end_of_turn>|(?=<start_of_turn>)|\Z)", re.S)),
)
# End-of-text and padding tokens a decode with special tokens leaves around a reply.
_END_TOKENS = re.compile(
    r"(<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>|<\|end_of_text\|>|<\|begin_of_text\|>|<end_of_turn>|<eos>|<bos>|</s>|<s>"
    r"|<\|end\|>|<\|eom_id\|>)"
)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)
ROLE_ALIASES = {"model": "assistant"}


def has_markup(text: str) -> bool:
    """Whether ``text`` holds the turn markers of a known chat-template family."""
    return any(marker in text for marker, _ in _FAMILIES)


def parse_turns(text: str) -> list[dict[str, Any]] | None:
    """The turns of template-rendered ``text``: ``[{"role", "content", "closed"}]`` (``closed``: the turn's
    end marker was there), or None when no known family's marker occurs."""
    for marker, pattern in _FAMILIES:
        if marker in text:
            turns = []
            for role, content, end in pattern.findall(text):
                turns.append(
                    {
                        "role": ROLE_ALIASES.get(role, role),
                        "content": strip_markup(content),
                        "closed": bool(end),
                    }
                )
            return turns
    return None


def strip_markup(text: str) -> str:
    """``text`` without end-of-text / padding tokens, surrounding whitespace trimmed."""
    return _END_TOKENS.sub("", text).strip()


def reply_fields(text: str) -> dict[str, Any]:
    """A generated assistant text as a judge ``response``: ``content`` and, when the text starts with a
    ``<think>`` block, ``reasoning_content``."""
    text = strip_markup(text)
    m = _THINK.match(text)
    if m is None:
        return {"content": text}
    return {"content": text[m.end() :].strip(), "reasoning_content": m.group(1).strip() or None}


def prompt_messages(text: str) -> list[dict[str, Any]]:
    """A prompt string as context messages: template turns without the open generation prompt; text without
    markup is one user message (none when empty)."""
    turns = parse_turns(text)
    if turns is None:
        stripped = strip_markup(text)
        return [{"role": "user", "content": stripped}] if stripped else []
    if turns and turns[-1]["role"] == "assistant" and not turns[-1]["closed"] and not turns[-1]["content"]:
        turns = turns[:-1]
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def split_query(query: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """A rendered prompt + generated reply as (context messages, response), when ``query`` carries template
    markup and its last turn is the assistant's (the reply); None otherwise."""
    turns = parse_turns(query)
    if not turns or turns[-1]["role"] != "assistant":
        return None
    context = [{"role": t["role"], "content": t["content"]} for t in turns[:-1]]
    # The reply's own text: re-read from the raw query, so a <think> block is still seen before stripping.
    return context, reply_fields(_last_turn_raw(query))


def _last_turn_raw(text: str) -> str:
    for marker, pattern in _FAMILIES:
        if marker in text:
            matches = pattern.findall(text)
            return matches[-1][1] if matches else ""
    return text
