"""How one chat turn is answered over HTTP: the completion JSON or the SSE stream, and client disconnects.

Role: the API half of a chat request. :class:`ChatCall` is the request as the chat route validated it (the
OpenAI request, its extra fields, and the :class:`~policy_server.serving.chat_turn.ChatInput` the serving
layer gets); :meth:`ChatReply.begin` begins the serving layer's turn (session, render) and
:meth:`ChatReply.respond` generates and answers it once, as JSON or as an SSE stream
(policy_server.api.chat.streaming). The turn's record is committed before the client receives the end of the
answer (the final chunk when streaming).

Client disconnects: a client that hangs up must abort its engine work upstream. A reply nobody reads
must not keep the engine busy, and must not become a trainable turn. Detection:

- non-streaming: uvicorn does NOT cancel a handler whose client hung up, so the generation (and its turn
  record) runs as a task next to a watcher that awaits the next ASGI message; the body has been read in
  full by then, so that message is ``http.disconnect``, delivered as soon as the socket closes.
  Whichever ends first wins; a disconnect cancels the generation task (which closes the engine
  connection) and the answer becomes a 499 that nobody receives;
- streaming: the same watcher covers the wait for the first token; after that Starlette's
  StreamingResponse listens for the disconnect itself and cancels the body iterator, and the response's
  background task closes the iterator in every case, so its ``finally`` always sees how it ended.

What then happens to the generation and its record is policy_server.serving.undelivered's contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from engine.chat import parse_assistant_output, prompt_opens_think
from engine.disconnect import CLIENT_CLOSED_STATUS, ClientGone, unless_disconnected
from engine.errors import EngineError
from policy_server.api import openai_fields as fields
from policy_server.api import openai_schemas as oa
from policy_server.api.chat import completions
from policy_server.api.chat.streaming import ChatStream, assistant_message, logprob_entries, sse_events
from policy_server.serving.chat_turn import ChatInput, ChatTurn
from policy_server.state import PolicyState


@dataclass(frozen=True)
class ChatCall:
    """A chat request as the chat route validated it: the OpenAI request, its extra fields, and the serving
    layer's input."""

    req: oa.ChatRequest
    extras: fields.ChatExtras
    turn: ChatInput


async def _first_delta(deltas: AsyncGenerator[str, None]) -> str | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


class ChatReply:
    """The HTTP answer of one chat turn: answers it once, through :meth:`respond`."""

    def __init__(self, st: PolicyState, turn: ChatTurn, call: ChatCall) -> None:
        self.st, self.turn, self.call = st, turn, call
        self.model = call.req.model or st.settings.served_model_name
        self.parse_tools = call.req.tool_choice != "none"
        # One rule for the JSON answer, the stream and the record: the prompt says whether the reply starts
        # in reasoning. A forced reply is exactly the call the grammar allows: no reasoning block to split off.
        self.opened = not call.turn.forced and prompt_opens_think(st.generator.tokenizer, turn.prompt_ids)

    @classmethod
    async def begin(cls, st: PolicyState, call: ChatCall) -> ChatReply:
        """The serving layer's turn (side rules, backlog, session, render), ready to generate."""
        return cls(st, await ChatTurn.begin(st, call.turn), call)

    async def answer(self) -> JSONResponse:
        """The non-streaming answer: generate, parse, record, then the completion JSON."""
        turn, chat = self.turn, self.call.turn
        res = await self.st.generator.generate(turn.prompt_ids, chat.sp, turn.res)
        parsed = parse_assistant_output(
            res.text,
            opened=self.opened,
            reasoning_parser=None if chat.forced else self.st.generator.reasoning_parser,
            tool_parser=self.st.generator.tool_parser if self.parse_tools else None,
        )
        # A forced call cut short (max_tokens) is no call and no content: its markup never reaches the client.
        content = None if chat.forced and not parsed.tool_calls else parsed.content
        message = assistant_message(content, parsed.reasoning_content, parsed.tool_calls)
        await turn.finish_turn(res, message)
        extras = self.call.extras
        return JSONResponse(
            completions.completion(
                rid=turn.rid,
                model=self.model,
                message=message,
                finish=completions.finish_reason(res.finish, bool(parsed.tool_calls)),
                prompt_tokens=len(turn.prompt_ids),
                completion_tokens=len(res.response_ids),
                cached_tokens=res.cached_tokens,
                logprobs={"content": logprob_entries(turn, 0, len(res.response_ids))} if extras.logprobs else None,
                metadata=extras.metadata,
                hindsight=fields.hindsight_extension(res.weight_version, turn.sid),
            ),
            headers=fields.hindsight_headers(res.weight_version, turn.sid, turn.deletion_token),
        )

    async def respond(self, request: Request) -> Response:
        """The answer, or a 499 nobody receives when the client left before it; engine errors propagate."""
        turn, chat = self.turn, self.call.turn
        deltas = self.st.generator.stream(turn.prompt_ids, chat.sp, turn.res) if self.call.req.stream else None
        streaming = False
        try:
            if deltas is None:
                return await unless_disconnected(request, self.answer())
            # The first delta is awaited before answering, so a down engine is a real 503, not a broken stream.
            first_delta = await unless_disconnected(request, _first_delta(deltas))
            streaming = True
        except ClientGone:
            await asyncio.shield(turn.abandon("client disconnected before its answer"))
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except asyncio.CancelledError:
            turn.abandon("chat request cancelled")
            raise
        except EngineError as exc:
            turn.engine_failed(exc)
            raise
        finally:
            if not streaming:  # answered, failed or gone: the pairing this request owes is written now at the latest
                turn.settle()
        return self.stream(first_delta, deltas)

    def stream(self, first_delta: str | None, deltas: AsyncGenerator[str, None]) -> StreamingResponse:
        """The SSE answer after its first delta; the background task closes it however it ended."""
        req, turn = self.call.req, self.turn
        events = sse_events(
            ChatStream(
                turn=turn,
                model=self.model,
                parse_tools=self.parse_tools,
                forced_call=self.call.turn.forced,
                logprobs=bool(self.call.extras.logprobs),
                opened=self.opened,
                include_usage=bool((req.stream_options or {}).get("include_usage")),
                continuous_usage=bool((req.stream_options or {}).get("continuous_usage_stats")),
            ),
            first_delta,
            deltas,
        )
        # The background task runs after the body ends or the client left (Starlette cancels the body on
        # http.disconnect, then runs it): closing the iterator there runs its finally in every case.
        headers = {
            "Cache-Control": "no-cache",
            **fields.hindsight_headers(turn.res.weight_version, turn.sid, turn.deletion_token),
        }
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(self._close_stream, events),
        )

    async def _close_stream(self, events: AsyncGenerator[str, None]) -> None:
        try:
            await events.aclose()
        finally:
            self.turn.settle()
