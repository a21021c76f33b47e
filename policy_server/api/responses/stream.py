"""The streaming ``/v1/responses`` answer: the chat turn's chunks re-emitted as Responses events.

Contract (the event sequence OpenAI's SDK accumulates, every event with a growing ``sequence_number`` and
an ``event:`` line naming its type): ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then

- reasoning (``<think>`` text): ``response.reasoning_text.delta``... ``response.reasoning_text.done``;
- a message: ``response.content_part.added``, ``response.output_text.delta``... (with the tokens'
  log-probs when ``include`` asked for them), ``response.output_text.done``, ``response.content_part.done``;
- a function call: ``response.function_call_arguments.delta`` (the whole arguments: the chat stream sends
  each call once it parsed) and ``response.function_call_arguments.done``;

then ``response.output_item.done``, and at the end ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` ended it) with the whole response and its usage. A failure after the first event is
``response.failed`` with the error. ``on_done(message)`` runs before the final event (it stores the
response, so a client that continues from it at once finds it); if it fails, the final event is
``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from policy_server.api.responses import output as ro
from policy_server.errors import PolicyError

BuildResponse = Callable[..., dict[str, Any]]


def _delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e.get("top_logprobs") or []],
        }
        for e in entries
    ]


class ResponseEvents:
    """One streaming answer's event builder: tracks the open item, the finished items and the sequence."""

    def __init__(self, build: BuildResponse, hexid: str, *, logprobs: bool) -> None:
        self.build, self.hexid, self.logprobs = build, hexid, logprobs
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""
        self.text_logprobs: list[dict[str, Any]] = []
        self.created_at = time.time()

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def response(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> str:
        body = self.build(
            status=status, output=list(self.output), usage_obj=usage, created_at=self.created_at, error=error
        )
        return self.event(f"response.{status}" if status != "in_progress" else "response.in_progress", response=body)

    def _index(self) -> int:
        return len(self.output)

    def open_item(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open, self.text, self.text_logprobs = item, "", []
        out.append(self.event("response.output_item.added", output_index=self._index(), item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part=part,
                )
            )
        return out

    def text_delta(self, kind: str, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                out += self.open_item({"type": "reasoning", "id": f"rs_{self.hexid}", "summary": [], "content": []})
            else:
                out += self.open_item(
                    {
                        "type": "message",
                        "id": f"msg_{self.hexid}",
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    }
                )
        assert self.open is not None
        self.text += delta
        where = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, delta=delta))
        else:
            self.text_logprobs += logprobs
            out.append(
                self.event("response.output_text.delta", **where, delta=delta, logprobs=_delta_logprobs(logprobs))
            )
        return out

    def calls(self, calls: list[dict[str, Any]]) -> list[str]:
        out = self.close()
        for i, call in enumerate(calls):
            fn = call.get("function") or {}
            done = ro.call_item(f"fc_{self.hexid}_{i}", {"id": call.get("id"), "function": fn})
            index = self._index()
            # A call is announced whole: added (empty arguments), its arguments as one delta, then done.
            args = done["arguments"]
            out += [
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**done, "arguments": "", "status": "in_progress"},
                ),
                self.event(
                    "response.function_call_arguments.delta", item_id=done["id"], output_index=index, delta=args
                ),
                self.event(
                    "response.function_call_arguments.done", item_id=done["id"], output_index=index, arguments=args
                ),
            ]
            out.append(self.event("response.output_item.done", output_index=index, item=done))
            self.output.append(done)
        return out

    def close(self) -> list[str]:
        """Finish the open item (if any): its done events, and it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        if item["type"] == "reasoning":
            done = ro.reasoning_item(item["id"], self.text)
            out = [self.event("response.reasoning_text.done", **where, text=self.text)]
        else:
            lps = self.text_logprobs if self.logprobs else None
            done = ro.message_item(item["id"], self.text, lps)
            part = done["content"][0]
            out = [
                self.event(
                    "response.output_text.done", **where, text=self.text, logprobs=_delta_logprobs(self.text_logprobs)
                ),
                self.event("response.content_part.done", **where, part=part),
            ]
        out.append(self.event("response.output_item.done", output_index=self._index(), item=done))
        self.output.append(done)
        return out


async def response_events(
    chunks: AsyncIterator[dict[str, Any]],
    builder: ResponseEvents,
    on_done: Callable[[dict[str, Any]], Awaitable[None]],
) -> AsyncIterator[str]:
    """The Responses events of one chat stream (see the module docstring)."""
    yield builder.event(
        "response.created",
        response=builder.build(status="in_progress", output=[], usage_obj=None, created_at=builder.created_at),
    )
    yield builder.response("in_progress")
    message: dict[str, Any] = {"role": "assistant", "content": None}
    finish, usage, failed = None, None, False
    async for chunk in chunks:  # read to its end, whatever happens: the chat stream settles its turn there
        if failed:
            continue
        if "error" in chunk:
            for e in builder.close():
                yield e
            err = chunk["error"]
            yield builder.response("failed", error={"code": "server_error", "message": str(err.get("message"))})
            failed = True
            continue
        if chunk.get("usage") and not chunk.get("choices"):
            u = chunk["usage"]
            usage = ro.usage(u["prompt_tokens"], u["completion_tokens"])
            continue
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        entries = (choice.get("logprobs") or {}).get("content") or []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if delta.get(key):
                message[key] = (message.get(key) or "") + delta[key]
                for e in builder.text_delta(kind, delta[key], entries):
                    yield e
        if delta.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": c["function"]} for c in delta["tool_calls"]
            ]
            for e in builder.calls(delta["tool_calls"]):
                yield e
        finish = choice.get("finish_reason") or finish
    if failed:
        return
    for e in builder.close():
        yield e
    try:
        await on_done(message)
    except PolicyError as exc:  # e.g. the store was busy: the answer cannot be continued from, so it failed
        yield builder.response("failed", error={"code": "server_error", "message": exc.message})
        return
    yield builder.response("incomplete" if finish == "length" else "completed", usage=usage)
