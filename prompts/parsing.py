"""Parsing of judge outputs: the verdict in the last ``\\boxed{...}`` and the hint between markers.

Contract:
- Only the judge's *final answer* is read: everything up to the last ``</think>`` is dropped, and an
  unclosed ``<think>`` (generation cut by max_new_tokens) means there is no final answer -> None.
- ``parse_verdict(text, allowed)`` takes the LAST ``\\boxed{...}`` of the final answer and accepts
  ``\\boxed{1}``, ``\\boxed{+1}``, ``\\boxed{ 1 }``, ``\\boxed{1.0}``, ``\\boxed{\\text{-1}}``, ``\\boxed{\\mathbf{1}}``;
  a value that is not an integer, or not in ``allowed``, gives None (never a default score).
- ``parse_hint(text)`` returns the stripped text of the LAST ``[HINT_START]...[HINT_END]`` of the final
  answer, or None (missing markers, empty hint).
Judged text cannot forge these: the renderer escapes ``\\boxed`` and the hint markers inside judged
content (prompts.render.neutralise), so a box or marker can only come from the judge itself.
"""

from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}")  # two nesting levels
_WRAPPER_RE = re.compile(r"^\\(?:text|textbf|mathbf|mathrm|bf)\s*\{(.*)\}$", re.DOTALL)
_NUMBER_RE = re.compile(r"^([+-]?)\s*(\d+(?:\.\d+)?)$")
_HINT_RE = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


def final_answer(text: str) -> str | None:
    """The part of a judge output after its reasoning; None when the reasoning never closed."""
    if text is None:
        return None
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def _to_int(inner: str) -> int | None:
    s = inner.strip().replace("$", "").strip()
    for _ in range(3):  # nested wrappers such as \text{\textbf{1}}
        m = _WRAPPER_RE.match(s)
        if not m:
            break
        s = m.group(1).strip()
    m = _NUMBER_RE.match(s)
    if not m:
        return None
    value = float(m.group(2))
    if value != int(value):
        return None
    return -int(value) if m.group(1) == "-" else int(value)


def _last_match(text: str, pattern: re.Pattern[str]) -> str | None:
    """The last ``pattern`` group in the final answer of ``text``, or None (no final answer, or no match)."""
    answer = final_answer(text)
    matches = pattern.findall(answer) if answer else []
    return matches[-1] if matches else None


def parse_verdict(text: str, allowed: set[int] | frozenset[int]) -> int | None:
    """The integer in the last ``\\boxed{}`` of the final answer if it is in ``allowed``, else None."""
    box = _last_match(text, _BOX_RE)
    value = None if box is None else _to_int(box)
    return value if value is not None and value in allowed else None


def parse_hint(text: str) -> str | None:
    """The stripped text of the last ``[HINT_START]...[HINT_END]`` of the final answer, or None."""
    hint = _last_match(text, _HINT_RE)
    return (hint or "").strip() or None
