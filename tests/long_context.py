"""A synthetic agent conversation of a given length in tokens, for the judge's prompt-layout test and bench.

Messages alternate user/assistant, each 60 words drawn from a small file-management vocabulary by ``rng``
(seeded by the caller), until the conversation holds at least ``target_tokens`` tokens of ``tok``.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "file folder rename report summary please move the to and check list error output tool result again docs work path"
)


def long_context(tok: Any, target_tokens: int, rng: random.Random, tag: str = "") -> tuple[list[dict[str, str]], int]:
    """(messages, tokens used): ``tag`` prefixes every message (so two conversations share no prefix)."""
    words = WORDS.split()
    context: list[dict[str, str]] = []
    used = 0
    while used < target_tokens:
        text = (f"[{tag}] " if tag else "") + " ".join(rng.choice(words) for _ in range(60))
        context.append({"role": "user" if len(context) % 2 == 0 else "assistant", "content": text})
        used += len(tok.encode(text, add_special_tokens=False))
    return context, used
