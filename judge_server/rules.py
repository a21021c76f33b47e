"""The engine-free keyword rule judge (``backend: rules``), for deterministic tests and the CPU demo.

Contract (keep exact: other parts' tests depend on it):
- Text examined: the contents of all next-state messages, joined, lower-cased.
- PRM: -1 if any ``rules_negative`` keyword occurs (default: wrong, not what, redo, incorrect, error,
  failed, "no,"); else +1 if any ``rules_positive`` keyword occurs (default: thanks, thank you, worked,
  works, great, perfect, correct) or the next state contains a ``tool`` message (a tool result without
  an error); else 0. Negative keywords win over positive ones ("thanks, but that's wrong" is -1),
  because a correction outweighs politeness.
- Keywords match case-insensitively on word boundaries at their alphabetic ends (so "correct" does not
  match inside "incorrect", and "no," matches "No, I meant ...").
- Hint: decision +1 (accepted) exactly when the PRM verdict is -1; the hint is the stripped next-state
  text (its messages' contents joined by newlines); otherwise decision -1 and no hint. The hint still goes
  through the ordinary selection rule (longer than ``hint_min_chars``, default 10 characters).
- Votes: the verdict repeated m times, through the same voting code as the LLM backend.
- Version: ``rules@<sha256-12>`` of the keyword lists, reported as prompt_versions for both tasks.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from judge_server.voting import Vote


def _keyword_re(word: str) -> re.Pattern[str]:
    w = word.lower().strip()
    prefix = r"\b" if w[:1].isalnum() else ""
    suffix = r"\b" if w[-1:].isalnum() else ""
    return re.compile(prefix + re.escape(w) + suffix)


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


class RuleJudge:
    def __init__(self, positive: list[str], negative: list[str]):
        self.positive = [w for w in positive if w.strip()]
        self.negative = [w for w in negative if w.strip()]
        self._pos = [_keyword_re(w) for w in self.positive]
        self._neg = [_keyword_re(w) for w in self.negative]
        blob = json.dumps({"positive": self.positive, "negative": self.negative}, sort_keys=True).encode()
        self.version = f"rules@{hashlib.sha256(blob).hexdigest()[:12]}"

    def next_state_text(self, next_state: list[dict[str, Any]]) -> str:
        return "\n".join(_text_of(m.get("content")) for m in next_state).strip()

    def prm_verdict(self, next_state: list[dict[str, Any]]) -> int:
        text = self.next_state_text(next_state).lower()
        if any(p.search(text) for p in self._neg):
            return -1
        if any(p.search(text) for p in self._pos) or any(m.get("role") == "tool" for m in next_state):
            return 1
        return 0

    def hint_vote(self, next_state: list[dict[str, Any]]) -> Vote:
        if self.prm_verdict(next_state) == -1:
            hint = self.next_state_text(next_state)
            return Vote(value=1, hint=hint, text=f"rules: correction -> hint {hint!r}")
        return Vote(value=-1, hint=None, text="rules: no correction")

    def prm_vote(self, next_state: list[dict[str, Any]]) -> Vote:
        v = self.prm_verdict(next_state)
        return Vote(value=v, text=f"rules: verdict {v}")
