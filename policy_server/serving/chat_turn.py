"""One chat completion from a validated request to the answer: session, generation, record, delivery.

:meth:`ChatTurn.begin` takes a :class:`ChatInput` (validated by the API layer) and does what must happen
before generating: the backlog check (a main turn is refused with 503 while the store holds too many
unconsumed samples), the session's arrival (or the inferred session's claim) and the prompt's render. A
render that fails still writes the pairing the request owes. :meth:`ChatTurn.respond` then answers as
JSON or as an SSE stream. Only main turns of a session are recorded; the record is committed before the
client receives the end of the answer (the final chunk when streaming).

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
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from engine.chat import DEFAULT_REASONING_PARSER, DEFAULT_TOOL_PARSER, parse_assistant_output
from engine.disconnect import CLIENT_CLOSED_STATUS, ClientGone, unless_disconnected
from engine.errors import EngineError
from engine.records import TurnRecord
from policy_server.api import openai_fields as fields
from policy_server.api import openai_schemas as oa
from policy_server.api.streaming import assistant_message, sse_events
from policy_server.errors import Backpressure
from policy_server.serving.generation import GenResult
from policy_server.serving.identity import HEADER, INFERRED, Identity, SessionHint
from policy_server.serving.sessions import Arrival
from policy_server.serving.side_rules import HEADER_RULE
from policy_server.serving.tool_choice import GRAMMAR_KEYS
from policy_server.serving.undelivered import abandon_detached, engine_failed
from policy_server.state import PolicyState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatInput:
    """A chat request as the API layer validated it, with its session headers."""

    req: oa.ChatRequest
    messages: list[dict[str, Any]]  # validated, in the shape the chat template renders
    extras: fields.ChatExtras
    sp: dict[str, Any]  # the engine's sampling params, any grammar included
    forced: bool  # tool_choice forces a call
    sid: str | None
    turn_type: str  # "main" or "side"
    done: bool  # the request ends its session
    # The answer's id is ``id_prefix + hex`` (chat ``chatcmpl-``, Responses ``resp_``, Messages ``msg_``): the
    # turn records the id its client got, which is how /v1/feedback names the turn.
    id_prefix: str = "chatcmpl-"
    # The session key and the rule that gave it (policy_server.serving.identity); None: ``sid`` as a header.
    hint: SessionHint | None = None
    typed: bool = True  # the client said the turn type; False: the side rules may make a main request side


async def check_backlog(st: PolicyState) -> None:
    """Backpressure (503) while the store holds ``max_unconsumed_samples`` or more unconsumed samples."""
    value, at = st.backlog_cache
    if time.monotonic() - at > 1.0:  # one COUNT per second at most, not per request
        value = float(await asyncio.to_thread(st.store.unconsumed_backlog))
        st.backlog_cache[:] = [value, time.monotonic()]
    if value >= st.settings.max_unconsumed_samples:
        st.metrics.backpressure.inc()
        raise Backpressure(
            f"sample store holds {int(value)} unconsumed samples (limit "
            f"{st.settings.max_unconsumed_samples}); the trainer must lease/ack before new main turns"
        )


def turn_record(
    messages: list[dict[str, Any]],
    tools: Any,
    res: GenResult,
    message: dict[str, Any],
    sp: dict[str, Any],
    template_kwargs: dict[str, Any] | None,
    response_id: str | None = None,
    identity: Identity | None = None,
) -> dict[str, Any]:
    """The turn's :class:`~engine.records.TurnRecord` JSON, as the store persists it; ``response_id`` is the
    id the client got for the reply (explicit feedback names the turn by it).

    The two fields that grow with the history are validated where they are made, the request's messages by
    the API layer and the prompt ids by the renderer: the record is validated with an empty stand-in of each
    and carries the originals, so a 30k-token turn is not walked twice more (validation and dump)."""
    record = TurnRecord(
        chat_template_kwargs=template_kwargs,  # the teacher renders its prompt the same way
        messages=[],
        tools=tools,
        prompt_ids=[],
        response_ids=res.response_ids,
        rollout_logprobs=res.logprobs,
        response={k: message.get(k) for k in ("content", "reasoning_content", "tool_calls")},
        weight_version=res.weight_version,
        weight_versions=res.weight_versions,
        sampling_params=sp,
        # A forced tool call or a JSON response format decodes under a grammar: the log-probs are the
        # masked distribution's.
        constrained=any(k in sp for k in GRAMMAR_KEYS),
        response_id=response_id,
        session_rule=identity.rule if identity is not None else None,
        session_decision=identity.decision if identity is not None else None,
    ).to_json()
    record["messages"], record["prompt_ids"] = messages, res.prompt_ids  # keys keep their places
    return record


async def _first_delta(deltas: AsyncIterator[str]) -> str | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


class ChatTurn:
    """One chat request after its prompt is rendered: answers it once, through :meth:`respond`.

    ``sid``, ``res`` and ``record_task`` are what the disconnect cleanup reads
    (policy_server.serving.undelivered.TurnInFlight). Whatever way the request ends, the pairing its
    ``arrival`` owes is written: by the turn record, else by ``settle_later``.
    """

    def __init__(
        self,
        st: PolicyState,
        chat: ChatInput,
        *,
        sid: str | None,
        record: bool,
        arrival: Arrival | None,
        template_kwargs: dict[str, Any] | None,
        prompt_ids: list[int],
        identity: Identity | None = None,
        side_rule: str | None = None,
    ) -> None:
        self.st, self.chat, self.sid, self.record, self.arrival = st, chat, sid, record, arrival
        self.identity, self.side_rule = identity, side_rule
        self.template_kwargs, self.prompt_ids = template_kwargs, prompt_ids
        self.model = chat.req.model or st.settings.served_model_name
        hexid = uuid.uuid4().hex
        self.rid = f"{chat.id_prefix}{hexid}"
        self.parse_tools = chat.req.tool_choice != "none"
        # Engine rids "hs-<hex>-<segment>": unique per submission, one abort prefix per chat request.
        self.res = GenResult(
            prompt_ids=list(prompt_ids), rid_prefix=f"hs-{hexid}-", top_logprobs_num=chat.extras.top_logprobs or 0
        )
        self.record_task: asyncio.Task[int] | None = None  # the turn record on its way into the store

    @classmethod
    async def begin(cls, st: PolicyState, chat: ChatInput) -> ChatTurn:
        """Side rules, backlog check, the session (policy_server.serving.identity) and the render: the turn,
        ready to generate."""
        hint = chat.hint or (SessionHint(chat.sid, HEADER) if chat.sid is not None else SessionHint(None, INFERRED))
        side_rule = None
        if chat.turn_type == "side":
            side_rule = HEADER_RULE if chat.typed else "default_turn_type"
        elif not chat.typed and st.side_rules is not None:
            side_rule = st.side_rules.match(chat.messages)
        main = side_rule is None
        assert st.resolver is not None
        if main and (hint.key is not None or hint.previous_response_id is not None or st.resolver.inferrer):
            await check_backlog(st)
        ident = await st.resolver.resolve(hint, chat.messages, main=main, done=chat.done)
        record = main and ident.sid is not None
        st.metrics.turns.labels(turn_type="main" if record else "side").inc()
        if side_rule is not None:
            st.metrics.side_turns.labels(rule=side_rule).inc()
        template_kwargs = fields.chat_template_kwargs(chat.extras)
        try:
            rendered = await st.generator.render(
                chat.messages,
                chat.req.tools,
                template_kwargs,
                ident.arrival.prior if ident.arrival is not None else None,
            )
        except BaseException:
            st.sessions.settle_later(ident.arrival)  # refused before generating: the pairing it owes is written anyway
            raise
        st.metrics.prompt_renders.labels(reason=rendered.reason).inc()
        st.metrics.prompt_tokens.labels(kind="reused").inc(rendered.reused_tokens)
        st.metrics.prompt_tokens.labels(kind="rendered").inc(len(rendered.ids) - rendered.reused_tokens)
        prompt_ids = rendered.ids
        # The turn's fields by name (the route builds its request the same way; the likeness is incidental).
        return cls(
            st,
            chat,
            sid=ident.sid,
            record=record,
            arrival=ident.arrival,
            template_kwargs=template_kwargs,
            prompt_ids=prompt_ids,
            identity=ident,
            side_rule=side_rule,
        )

    def logprob_entries(self, start: int, end: int) -> list[dict[str, Any]]:
        """The OpenAI ``logprobs.content`` entries of response tokens ``[start, end)``."""
        r = self.res
        return fields.token_logprobs(
            self.st.generator.tokenizer,
            r.response_ids[start:end],
            r.logprobs[start:end],
            r.top_logprobs[start:end] if r.top_logprobs_num else None,
        )

    async def finish_turn(self, res: GenResult, message: dict[str, Any]) -> None:
        """Count resumes and, for a recorded turn, commit its record before the client gets the end."""
        st, chat = self.st, self.chat
        st.metrics.resumes.inc(res.resumes)
        st.metrics.prompt_tokens.labels(kind="cached").inc(res.cached_tokens or 0)
        if self.record:
            assert self.sid is not None
            self.record_task = asyncio.ensure_future(
                st.sessions.on_main_turn(
                    self.sid,
                    turn_record(
                        chat.messages,
                        chat.req.tools,
                        res,
                        message,
                        chat.sp,
                        self.template_kwargs,
                        self.rid,
                        self.identity,
                    ),
                    done=chat.done,
                    arrival=self.arrival,
                )
            )
            # Shielded: a disconnect now must not lose track of a write that commits anyway (see undelivered).
            await asyncio.shield(self.record_task)
        elif self.side_rule is not None:
            record = turn_record(chat.messages, chat.req.tools, res, message, chat.sp, self.template_kwargs)
            try:  # kept for operators; a failed write must not fail an answer that trains nothing
                await asyncio.shield(asyncio.to_thread(st.store.record_side_turn, self.sid, self.side_rule, record))
            except Exception:
                logger.exception("recording a side turn (rule %s) failed", self.side_rule)

    def engine_failed(self, exc: EngineError) -> None:
        engine_failed(self.st, self, exc)

    async def answer(self) -> JSONResponse:
        """The non-streaming answer: generate, parse, record, then the completion JSON."""
        chat = self.chat
        res = await self.st.generator.generate(self.prompt_ids, chat.sp, self.res)
        # A forced reply is exactly the call the grammar allows: no reasoning block to split off.
        parsed = parse_assistant_output(
            res.text,
            reasoning_parser=None if chat.forced else DEFAULT_REASONING_PARSER,
            tool_parser=DEFAULT_TOOL_PARSER if self.parse_tools else None,
        )
        # A forced call cut short (max_tokens) is no call and no content: its markup never reaches the client.
        content = None if chat.forced and not parsed.tool_calls else parsed.content
        message = assistant_message(content, parsed.reasoning_content, parsed.tool_calls)
        await self.finish_turn(res, message)
        return JSONResponse(
            oa.completion(
                rid=self.rid,
                model=self.model,
                message=message,
                finish=oa.finish_reason(res.finish, bool(parsed.tool_calls)),
                prompt_tokens=len(self.prompt_ids),
                completion_tokens=len(res.response_ids),
                cached_tokens=res.cached_tokens,
                logprobs={"content": self.logprob_entries(0, len(res.response_ids))} if chat.extras.logprobs else None,
                metadata=chat.extras.metadata,
                hindsight=fields.hindsight_extension(res.weight_version, self.sid),
            ),
            headers=fields.hindsight_headers(res.weight_version, self.sid),
        )

    async def respond(self, request: Request) -> Response:
        """The answer, or a 499 nobody receives when the client left before it; engine errors propagate."""
        st = self.st
        deltas = st.generator.stream(self.prompt_ids, self.chat.sp, self.res) if self.chat.req.stream else None
        streaming = False
        try:
            if deltas is None:
                return await unless_disconnected(request, self.answer())
            # The first delta is awaited before answering, so a down engine is a real 503, not a broken stream.
            first_delta = await unless_disconnected(request, _first_delta(deltas))
            streaming = True
        except ClientGone:
            await asyncio.shield(abandon_detached(st, self, "client disconnected before its answer"))
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except asyncio.CancelledError:
            abandon_detached(st, self, "chat request cancelled")
            raise
        except EngineError as exc:
            self.engine_failed(exc)
            raise
        finally:
            if not streaming:  # answered, failed or gone: the pairing this request owes is written now at the latest
                st.sessions.settle_later(self.arrival)
        return self.stream(first_delta, deltas)

    def stream(self, first_delta: str | None, deltas: AsyncGenerator[str, None]) -> StreamingResponse:
        """The SSE answer after its first delta; the background task closes it however it ended."""
        chat = self.chat

        def undelivered() -> None:
            # Cancelled at an await (Starlette saw http.disconnect) or closed at a yield (the background aclose).
            # Detached: awaiting here could be cancelled again. An EngineTimeout may have started it already.
            if not self.res.abandoned:
                abandon_detached(self.st, self, "client disconnected mid-stream", close=deltas)

        events = sse_events(
            rid=self.rid,
            model=self.model,
            first=first_delta,
            deltas=deltas,
            res=self.res,
            parse_tools=self.parse_tools,
            forced_call=chat.forced,
            logprob_entries=self.logprob_entries if chat.extras.logprobs else None,
            include_usage=bool((chat.req.stream_options or {}).get("include_usage")),
            continuous_usage=bool((chat.req.stream_options or {}).get("continuous_usage_stats")),
            finish_turn=self.finish_turn,
            on_engine_error=self.engine_failed,
            on_undelivered=undelivered,
        )
        # The background task runs after the body ends or the client left (Starlette cancels the body on
        # http.disconnect, then runs it): closing the iterator there runs its finally in every case.
        headers = {"Cache-Control": "no-cache", **fields.hindsight_headers(self.res.weight_version, self.sid)}
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(self._close_stream, events),
        )

    async def _close_stream(self, events: AsyncIterator[str]) -> None:
        try:
            await events.aclose()  # type: ignore[attr-defined]  # sse_events is an async generator
        finally:
            self.st.sessions.settle_later(self.arrival)
