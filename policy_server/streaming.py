"""Incremental split of streamed assistant text into reasoning and content deltas (pure).

Role: lets the policy server stream real token-by-token deltas while ending with exactly what
``engine.chat.parse_assistant_output`` says about the whole text. Rules:

- A leading ``<think>`` block streams as ``reasoning_content`` deltas; text after ``</think>`` streams as
  ``content`` (its leading newlines dropped, as the parser does).
- Content streams until a ``<tool_call>`` tag; from there the text is held and, at the end, the parsed
  tool calls are sent as complete ``tool_calls`` deltas (name and arguments in one delta per call).
- A trailing partial tag (``</thi``) or trailing whitespace is held back until the next text shows
  what it is, so no marker fragment ever reaches the client.
- ``finish()`` reconciles with the full parse: any content the parser keeps that was not streamed yet
  (e.g. an invalid ``<tool_call>`` block the parser leaves in the content) is sent then.
"""

from __future__ import annotations

from typing import Any

from engine.chat import parse_assistant_output

THINK_OPEN, THINK_CLOSE, TOOL_OPEN = "<think>", "</think>", "<tool_call>"


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamSplitter:
    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0
        self.mode = "start"  # start | think | content | tool
        self.reasoning = ""
        self.content = ""
        self._first_content = True

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Add newly sampled text; returns ("reasoning"|"content", delta) pairs to send now."""
        self.buf += text
        out: list[tuple[str, str]] = []
        progressed = True
        while progressed:
            progressed = False
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.pos = len(self.buf) - len(head) + len(THINK_OPEN)
                    self.mode, progressed = "think", True
                elif head and not THINK_OPEN.startswith(head):
                    self.mode, progressed = "content", True
            elif self.mode == "think":
                idx = self.buf.find(THINK_CLOSE, self.pos)
                if idx >= 0:
                    self._emit(out, "reasoning", self.buf[self.pos:idx].rstrip())
                    self.pos = idx + len(THINK_CLOSE)
                    self.mode, progressed = "content", True
                else:
                    self._emit_safe(out, "reasoning", THINK_CLOSE)
            elif self.mode == "content":
                idx = self.buf.find(TOOL_OPEN, self.pos)
                if idx >= 0:
                    self._emit(out, "content", self.buf[self.pos:idx].rstrip())
                    self.pos = idx
                    self.mode = "tool"
                else:
                    self._emit_safe(out, "content", TOOL_OPEN)
        return out

    def _emit_safe(self, out: list[tuple[str, str]], kind: str, tag: str) -> None:
        tail = self.buf[self.pos:]
        hold = _partial_tag_len(tail, tag)
        safe = tail[: len(tail) - hold]
        safe = safe.rstrip()  # trailing whitespace waits: it may end the block and be stripped
        self._emit(out, kind, safe)

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        """Send ``text`` (which starts at self.pos) and advance past it."""
        if not text:
            return
        start = self.pos
        if kind == "reasoning" and not self.reasoning:
            text = text.lstrip()
        if kind == "content" and self._first_content:
            text = text.lstrip("\n")
        if not text:
            return
        self.pos = self.buf.index(text, start) + len(text)
        if kind == "reasoning":
            self.reasoning += text
        else:
            self._first_content = False
            self.content += text
        out.append((kind, text))

    def finish(self) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
        """The last deltas and the tool calls, consistent with parse_assistant_output(full text)."""
        final = parse_assistant_output(self.buf)
        out: list[tuple[str, str]] = []
        reasoning = final.reasoning_content or ""
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append(("reasoning", reasoning[len(self.reasoning):]))
            self.reasoning = reasoning
        if final.content.startswith(self.content) and len(final.content) > len(self.content):
            out.append(("content", final.content[len(self.content):]))
            self.content = final.content
        return out, final.tool_calls
