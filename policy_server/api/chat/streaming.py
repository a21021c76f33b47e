"""How a chat answer reaches the client: the SSE event stream, client-disconnect detection, and the
incremental split of streamed assistant text into reasoning and content deltas.

:func:`sse_events` is the body of a streaming ``/v1/chat/completions`` answer (OpenAI chunks, an in-band
error event, ``data: [DONE]``) for one :class:`ChatStream` (the turn and what its client asked of the
stream); it ends the turn through the turn itself (policy_server.serving.chat_turn.ChatTurn: its record
before the final chunk, its engine failure, and ``abandon_stream`` from its ``finally`` whenever it did not
get to ``[DONE]``, i.e. it was cancelled at an await (Starlette's StreamingResponse saw ``http.disconnect``)
or closed at a yield (the response's background ``aclose``)). ``engine.disconnect.unless_disconnected``
runs work next to a watcher of the ASGI ``receive`` channel (see its docstring). Both are used by
policy_server.api.chat.answer.

:class:`StreamSplitter` (pure) lets the policy server stream real token-by-token deltas while ending with
exactly what ``engine.chat.parse_assistant_output`` says about the whole text, under the same rule (whether
the prompt opened a ``<think>`` block), so a client that streams and one that does not get the same reply,
and the turn record holds what the client was sent. Rules:

- A leading ``<think>`` block (or, when the prompt opened one, the text before the first ``</think>``)
  streams as ``reasoning_content`` deltas; text after ``</think>`` streams as ``content`` (its leading
  newlines dropped, as the parser does). Once content has been sent, nothing is ever sent as reasoning: a
  stray ``</think>`` later in the reply is content.
- With tool parsing on, content streams until the family's call marker (``<tool_call>``, ``[TOOL_CALLS]``...;
  the generator's parser, engine.tool_parsers); from there the text is held and, at the end, the parsed tool
  calls are sent as complete ``tool_calls`` deltas (name and arguments in one delta per call). A Llama 3 reply
  that opens as bare JSON and a gpt-oss reply (its channels) are held whole. With parsing off
  (``tool_choice: "none"``) a call marker is text like any other.
- A trailing partial tag (``</thi``) or trailing whitespace is held back until the next text shows
  what it is, so no marker fragment ever reaches the client.
- ``finish()`` reconciles with the full parse: any content the parser keeps that was not streamed yet
  (e.g. an invalid ``<tool_call>`` block the parser leaves in the content) is sent then.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from engine.chat import (
    DEFAULT_REASONING_PARSER,
    DEFAULT_TOOL_PARSER,
    ReasoningParser,
    ThinkReasoningParser,
    ToolCallParser,
    parse_assistant_output,
)
from engine.errors import EngineError
from policy_server.api import openai_fields as fields
from policy_server.api.chat import completions
from policy_server.errors import PolicyError, engine_error_status, error_body
from policy_server.serving.chat_turn import ChatTurn

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamSplitter:
    """``opened``: the prompt left a ``<think>`` block open (engine.chat.prompt_opens_think); ``parse_tools``:
    ``<tool_call>`` blocks become tool calls."""

    def __init__(
        self,
        *,
        opened: bool = False,
        parse_tools: bool = True,
        tool_parser: ToolCallParser = DEFAULT_TOOL_PARSER,
        reasoning_parser: ReasoningParser | None = DEFAULT_REASONING_PARSER,
    ) -> None:
        self.opened, self.parse_tools = opened, parse_tools
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        # Where a call starts in this family's markup: from there the text is held until the end.
        self.tool_open = tool_parser.open_tag
        # A family whose calls may be the whole reply as bare JSON (Llama 3): a reply that starts so is held.
        self.bare_calls: bool = getattr(tool_parser, "bare_start", False)
        # Only <think> blocks are split while streaming; a reply in other reasoning markup (gpt-oss's channels)
        # is held and split at the end, so no markup reaches the client as text.
        self.thinks = isinstance(reasoning_parser, ThinkReasoningParser)
        self.hold_all = reasoning_parser is not None and not self.thinks
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
                if self.hold_all:
                    self.mode = "tool"
                elif not self.thinks:
                    self.mode, progressed = ("tool" if self.held_as_call(head) else "content"), bool(head)
                elif head.startswith(THINK_OPEN):
                    self.pos = len(self.buf) - len(head) + len(THINK_OPEN)
                    self.mode, progressed = "think", True
                elif head and not THINK_OPEN.startswith(head):
                    self.mode, progressed = ("think" if self.opened else "content"), True
            elif self.mode == "think":
                idx = self.buf.find(THINK_CLOSE, self.pos)
                if idx >= 0:
                    self._emit(out, "reasoning", self.buf[self.pos : idx].rstrip())
                    self.pos = idx + len(THINK_CLOSE)
                    self.mode, progressed = "content", True
                else:
                    self._emit_safe(out, "reasoning", THINK_CLOSE)
            elif self.mode == "content":
                if not self.content and self.held_as_call(self.buf[self.pos :].lstrip()):
                    self.mode = "tool"
                    continue
                idx = self.buf.find(self.tool_open, self.pos) if self.parse_tools else -1
                if idx >= 0:
                    self._emit(out, "content", self.buf[self.pos : idx].rstrip())
                    self.pos = idx
                    self.mode = "tool"
                else:
                    self._emit_safe(out, "content", self.tool_open if self.parse_tools else "")
        return out

    def held_as_call(self, head: str) -> bool:
        """A reply (after its reasoning) that opens as bare JSON in a family whose calls may be bare JSON."""
        return self.parse_tools and self.bare_calls and head.startswith("{")

    def _emit_safe(self, out: list[tuple[str, str]], kind: str, tag: str) -> None:
        tail = self.buf[self.pos :]
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
        final = parse_assistant_output(
            self.buf,
            opened=self.opened,
            reasoning_parser=self.reasoning_parser,
            tool_parser=self.tool_parser if self.parse_tools else None,
        )
        out: list[tuple[str, str]] = []
        reasoning = final.reasoning_content or ""
        # Reasoning never follows content: the client would show it twice (and rebuild the reply differently).
        if not self.content and reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append(("reasoning", reasoning[len(self.reasoning) :]))
            self.reasoning = reasoning
        if final.content.startswith(self.content) and len(final.content) > len(self.content):
            out.append(("content", final.content[len(self.content) :]))
            self.content = final.content
        return out, final.tool_calls


# ---------------------------------------------------------------------------------------------- disconnects
# ClientGone, wait_for_disconnect and unless_disconnected live in engine.disconnect (shared with the judge).


# ---------------------------------------------------------------------------------------------- SSE body
def assistant_message(content: str | None, reasoning: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = calls
    return msg


def logprob_entries(turn: ChatTurn, start: int, end: int) -> list[dict[str, Any]]:
    """The OpenAI ``logprobs.content`` entries of the turn's response tokens ``[start, end)``."""
    r = turn.res
    return fields.token_logprobs(
        turn.st.generator.tokenizer,
        r.response_ids[start:end],
        r.logprobs[start:end],
        r.top_logprobs[start:end] if r.top_logprobs_num else None,
    )


@dataclass(frozen=True)
class ChatStream:
    """One streamed chat answer: the turn (its id, its result as it grows, how it ends) and what the client
    asked of the stream.

    ``forced_call``: the reply was constrained to one tool call, so a call cut short is sent as nothing
    (finish ``length``), never as content. ``logprobs``: each chunk after the role chunk carries the OpenAI
    entries of the tokens sampled since the previous one, the finish chunk the rest. ``continuous_usage``:
    every chunk carries the usage so far (``stream_options.continuous_usage_stats``)."""

    turn: ChatTurn
    model: str
    parse_tools: bool  # tool_choice is not "none": tool calls are parsed out of the text
    include_usage: bool
    continuous_usage: bool = False
    forced_call: bool = False
    logprobs: bool = False
    opened: bool = False  # the reply starts in reasoning (the prompt left a <think> block open; never forced)


async def sse_events(
    stream: ChatStream, first: str | None, deltas: AsyncGenerator[str, None]
) -> AsyncGenerator[str, None]:
    """The streaming answer after its ``first`` delta. The turn's record is committed before the final chunk;
    an engine failure is the turn's (and an in-band error event); a stream that did not get to ``[DONE]``
    calls ``turn.abandon_stream`` from ``finally``, which must not await: the task may be inside a cancelled
    scope by then."""
    turn, model, res, rid = stream.turn, stream.model, stream.turn.res, stream.turn.rid
    parse_tools, forced_call = stream.parse_tools, stream.forced_call
    created = int(time.time())
    sent_lp = 0

    def lp() -> dict[str, Any] | None:
        nonlocal sent_lp
        if not stream.logprobs:
            return None
        end = len(res.response_ids)
        entries, sent_lp = logprob_entries(turn, sent_lp, end), end
        return {"content": entries}

    def event(obj: dict[str, Any]) -> str:
        if stream.continuous_usage and obj.get("choices"):
            obj["usage"] = completions.usage(len(res.prompt_ids), len(res.response_ids))
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def out(pairs: list[tuple[str, str]]) -> list[str]:
        return [
            event(
                completions.chunk(
                    rid=rid,
                    model=model,
                    created=created,
                    logprobs=lp(),
                    delta={"reasoning_content" if k == "reasoning" else "content": t},
                )
            )
            for k, t in pairs
        ]

    gen = turn.st.generator
    splitter = StreamSplitter(
        opened=stream.opened,
        parse_tools=parse_tools,
        tool_parser=gen.tool_parser,
        reasoning_parser=None if forced_call else gen.reasoning_parser,
    )
    delivered = False
    try:
        try:
            yield event(
                completions.chunk(rid=rid, model=model, created=created, delta={"role": "assistant", "content": ""})
            )
            pending = [first] if first is not None else []
            while True:
                for text in pending:
                    for e in out(splitter.feed(text)):
                        yield e
                try:
                    pending = [await anext(deltas)]
                except StopAsyncIteration:
                    break
            tail, calls = splitter.finish()
            if forced_call and not calls:  # a forced call cut short: its markup is not content
                tail = [(k, t) for k, t in tail if k != "content"]
            for e in out(tail):
                yield e
            content = None if forced_call and not calls else splitter.content
            message = assistant_message(content, splitter.reasoning or None, calls)
            if calls:
                delta_calls = [
                    {
                        "index": i,
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    }
                    for i, c in enumerate(calls)
                ]
                yield event(
                    completions.chunk(
                        rid=rid, model=model, created=created, delta={"tool_calls": delta_calls}, logprobs=lp()
                    )
                )
            await turn.finish_turn(res, message)
            yield event(
                completions.chunk(
                    rid=rid,
                    model=model,
                    created=created,
                    delta={},
                    logprobs=lp(),
                    finish=completions.finish_reason(res.finish, bool(calls)),
                )
            )
            if stream.include_usage:
                yield event(
                    completions.chunk(
                        rid=rid,
                        model=model,
                        created=created,
                        usage_obj=completions.usage(len(res.prompt_ids), len(res.response_ids), res.cached_tokens),
                    )
                )
        except (EngineError, PolicyError) as exc:
            if isinstance(exc, EngineError):
                turn.engine_failed(exc)
            status = engine_error_status(exc) if isinstance(exc, EngineError) else exc.status_code
            yield event(error_body(status, str(getattr(exc, "message", exc)), "upstream_error"))
        yield "data: [DONE]\n\n"
        delivered = True
    finally:
        if not delivered:
            turn.abandon_stream(deltas)
