"""Runs a request of another API shape (OpenAI Responses, Anthropic Messages) as one chat turn.

Role: the one way an adapter reaches the pipeline. An adapter converts its request into a chat-completions
body (messages, tools, tool_choice and sampling fields only); :func:`run_chat_turn` validates that body with
the chat route's own validation, obtains the session the chat route's way (``session_info``, on the
adapter's original body, so the same headers and body fallbacks apply) and answers it with the one
:class:`~policy_server.api.chat.answer.ChatReply` lifecycle: the same render, the same engine path, the
same turn record, pairing, backpressure and disconnect handling as ``/v1/chat/completions``. The adapter
then converts the chat answer back (:class:`ChatAnswer`): the completion JSON, or the chat SSE stream as
parsed chunks, which it re-emits in its own event shape. Nothing here records, renders or generates.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from policy_server.api.chat import routes
from policy_server.api.chat.answer import ChatReply
from policy_server.serving.chat_turn import ChatTurn
from policy_server.serving.identity import SessionHint
from policy_server.state import PolicyState

SSE_DONE = "[DONE]"


@dataclass(frozen=True)
class SessionHeaders:
    """The session part of one request (policy_server.api.chat.routes.request_session): the session hint by the
    one precedence (policy_server.serving.identity), the turn type, whether the client typed it, done."""

    hint: SessionHint
    turn_type: str
    typed: bool
    done: bool


def request_session(request: Request, st: PolicyState, body: dict[str, Any]) -> SessionHeaders:
    """The session of a request of any shape, exactly as the chat route reads it (the body fallbacks are
    removed from ``body``; the adapter's own body, so its ``prompt_cache_key``, ``metadata`` and
    ``previous_response_id`` are hints too)."""
    hint, turn_type, typed, done = routes.request_session(request, body, st.settings.default_turn_type)
    return SessionHeaders(hint, turn_type, typed, done)


@dataclass(frozen=True)
class ChainInstructions:
    """A request's own instructions (leading system messages that apply to it alone, as Responses
    ``instructions`` do) and those the model saw in the turn its chain continues. Pairing compares the
    conversation under the earlier turn's instructions, so a chain stays one conversation whether a request
    repeats, omits or changes them; the prompt is rendered (and recorded) with the request's own."""

    own: int  # how many leading messages of the request are its own instructions
    previous: list[dict[str, Any]]  # the continued turn's instructions, as its record keeps them


@dataclass
class ChatAnswer:
    """What the chat lifecycle answered: ``completion`` (non-streaming, status 200), ``chunks`` (streaming:
    the chat chunks as dicts, an in-band ``{"error": ...}`` included), or ``response`` to send as is (e.g.
    the 499 nobody receives)."""

    reply: ChatReply
    response: Response
    completion: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None

    @property
    def turn(self) -> ChatTurn:
        return self.reply.turn

    @property
    def model(self) -> str:
        """The model name the answer carries (the request's, else the served name)."""
        return self.reply.model

    def restream(self, events: Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[str]]) -> StreamingResponse:
        """The streaming answer in another event shape: ``events(chunks)`` yields its SSE text. The chat
        stream's background task (which closes the chat stream however it ended, and settles the session's
        pairing) runs after this response too, and a client that hangs up cancels the chat stream through it."""
        assert isinstance(self.response, StreamingResponse) and self.chunks is not None
        headers = {
            k: v for k, v in self.response.headers.items() if k.lower() not in ("content-length", "content-type")
        }
        return StreamingResponse(
            events(self.chunks),
            media_type="text/event-stream",
            headers=headers,
            background=self.response.background,
        )


async def _chat_chunks(body: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[dict[str, Any]]:
    async for raw in body:
        text = raw if isinstance(raw, str) else bytes(raw).decode()
        for line in text.splitlines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            # Read on past [DONE] to the chat stream's end: it counts as delivered only once resumed after it.
            if data != SSE_DONE:
                yield json.loads(data)


async def run_chat_turn(
    request: Request,
    st: PolicyState,
    chat_body: dict[str, Any],
    session: SessionHeaders,
    *,
    id_prefix: str,
    instructions: ChainInstructions | None = None,
) -> ChatAnswer:
    """Validate ``chat_body`` as the chat route does, then begin and answer the chat turn; the turn's id (the
    one recorded, and the one its client gets) is ``id_prefix`` + hex. With ``instructions``, pairing
    compares the chain's conversation (:class:`ChainInstructions`)."""
    call = routes._chat_input(st, chat_body, session.hint, session.turn_type, session.done, session.typed, id_prefix)
    if instructions is not None:
        transcript = instructions.previous + call.turn.messages[instructions.own :]
        if transcript != call.turn.messages:
            call = dataclasses.replace(call, turn=dataclasses.replace(call.turn, transcript=transcript))
    reply = await ChatReply.begin(st, call)
    response = await reply.respond(request)
    if isinstance(response, StreamingResponse):
        return ChatAnswer(reply, response, chunks=_chat_chunks(response.body_iterator))
    if response.status_code != 200:
        return ChatAnswer(reply, response)
    return ChatAnswer(reply, response, completion=json.loads(bytes(response.body)))


def hindsight_headers(answer: ChatAnswer) -> dict[str, str]:
    """The ``X-Hindsight-*`` headers the chat answer carries (weight version, session id)."""
    return {k: v for k, v in answer.response.headers.items() if k.lower().startswith("x-hindsight-")}


def engine_stop(turn: ChatTurn) -> str | None:
    """The stop string that ended the generation, when one did (SGLang's ``finish_reason.matched``)."""
    matched = turn.res.finish.get("matched")
    return matched if isinstance(matched, str) else None
