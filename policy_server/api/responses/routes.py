"""The OpenAI Responses route, ``POST /v1/responses`` (thin): an adapter onto the one chat turn.

Key check, body, the session the chat route's way (headers, body fallbacks), the typed request
(policy_server.api.responses.shapes), then the conversation as chat messages: the stored conversation of
``previous_response_id`` (policy_server.store.responses), ``instructions`` as a leading system message, the
new input items. policy_server.api.chat_bridge answers it as one chat turn (same render, record, pairing,
judging, training as ``/v1/chat/completions``), and the answer is converted back: a ``response`` object
(policy_server.api.responses.output), or the Responses event stream (policy_server.api.responses.stream).

``store`` (default true) keeps the answer's conversation under its id, with its session: a request that
continues it with ``previous_response_id`` and no session of its own continues that session
(:func:`previous_response`), so a Responses tool loop is recorded and paired whether the client resends the
history or chains responses. An unknown ``previous_response_id`` is a 404.

``instructions`` apply to their own request (OpenAI's rule): never stored, never carried to a follow-up, so the
model sees exactly the instructions of the request it answers, and that is what the turn records. A chain is
still one conversation for pairing, whether a follow-up repeats, omits or changes them: the session layer
compares the chain under the instructions of the turn it continues (:func:`chain_instructions`). Repeated
instructions continue that turn's prompt tokens; omitted or changed ones are a prompt of their own (full render).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from engine.validation import clip
from policy_server.api import openai_schemas as oa
from policy_server.api.auth import require_client
from policy_server.api.bodies import read_json_object
from policy_server.api.chat_bridge import (
    ChainInstructions,
    ChatAnswer,
    hindsight_headers,
    request_session,
    run_chat_turn,
)
from policy_server.api.openai_fields import hindsight_extension
from policy_server.api.response_models_shapes import ResponseObject
from policy_server.api.responses import output as ro
from policy_server.api.responses import shapes as rs
from policy_server.api.responses.stream import ResponseEvents, response_events
from policy_server.api.route_docs import error_responses, json_request_body
from policy_server.errors import NotFound
from policy_server.serving.opt_out import NONE
from policy_server.state import PolicyState
from policy_server.store.records import StoredResponse

router = APIRouter()

RESPONSES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a response object, or with stream: true the Responses event stream",
        "model": ResponseObject,
        "content": {"text/event-stream": {}},
    },
    **error_responses(400, 401, 404, 413, 429, 502, 503, 504),
}


async def previous_response(st: PolicyState, response_id: str) -> tuple[list[dict[str, Any]], str | None]:
    """(conversation, session id) of a stored response: the chain ``previous_response_id`` -> session.
    An unknown id is a 404, as OpenAI answers it."""
    try:
        stored = await asyncio.to_thread(st.store.get_response, response_id)
    except LookupError as exc:  # a chain the store cannot walk to its start: nothing to continue from
        raise NotFound(str(exc), param="previous_response_id") from None
    if stored is None:
        raise NotFound(f"previous response with id {clip(response_id)} not found", param="previous_response_id")
    return stored.conversation, stored.session_id


def chain_instructions(st: PolicyState, response_id: str, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instructions the model saw in the recorded turn that answered ``response_id`` (blocking: a store read).

    The turn's messages are its instructions followed by the stored ``conversation`` up to the reply, which
    ends it: whatever leads beyond that is the instructions. No recorded turn (a side or unrecorded one), or
    a turn that does not have that shape: none (the conversation is compared as it is)."""
    found = st.store.turn_by_response_id(response_id)
    turn = st.store.get_turn(*found) if found is not None else None
    if turn is None:
        return []
    messages = turn.messages
    lead = len(messages) - (len(conversation) - 1)
    if lead not in (0, 1) or any(m.get("role") != "system" for m in messages[:lead]):
        return []
    return messages[:lead]


def _assistant(message: dict[str, Any]) -> dict[str, Any]:
    """The chat assistant message as a stored conversation keeps it (what the next turn renders and pairs)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    for key in ("reasoning_content", "tool_calls"):
        if message.get(key):
            out[key] = message[key]
    return out


@router.post(
    "/v1/responses",
    openapi_extra=json_request_body(oa.request_schema(rs.ResponsesRequest)),
    responses=RESPONSES_RESPONSES,
)
async def create_response(request: Request) -> Response:
    st: PolicyState = request.app.state.policy
    require_client(request, st.settings)
    body = await read_json_object(request, st.settings.max_json_depth)
    session = request_session(request, st, body)
    req = rs.parse_request(body)
    prefix: list[dict[str, Any]] = []
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chain: ChainInstructions | None = None
    if req.previous_response_id is not None:
        # The conversation it continues; its session (when no header or other hint names one) is found by
        # the session resolver's previous_response rule, like any other hint.
        prefix, _ = await previous_response(st, req.previous_response_id)
        # Instructions apply to their own request (OpenAI's rule): the model sees this request's only, and
        # pairing compares the chain under the instructions the continued turn was answered with.
        previous = await asyncio.to_thread(chain_instructions, st, req.previous_response_id, prefix)
        chain = ChainInstructions(own=len(system), previous=previous)
    new_messages = rs.input_messages(req.input)
    conversation = prefix + new_messages
    chat = rs.chat_body(req, system + conversation)
    answer = await run_chat_turn(request, st, chat, session, id_prefix="resp_", instructions=chain)
    rid, model = answer.turn.rid, answer.model
    hexid = rid.removeprefix("resp_")  # the output items' ids share it (msg_, fc_, rs_)
    build = functools.partial(
        ro.response_object, req, rid=rid, model=model, hindsight=hindsight_extension(None, answer.turn.sid)
    )

    async def store(message: dict[str, Any]) -> None:
        if req.store and session.hint.train != NONE:  # "store nothing" keeps no answer either
            added = [*new_messages, _assistant(message)]  # what this answer adds to the stored chain
            if st.secrets is not None:
                added = (await asyncio.to_thread(st.secrets.redact, added))[0]
            stored = StoredResponse(rid, answer.turn.sid, req.previous_response_id, added)
            await asyncio.to_thread(st.store.put_response, stored)

    if answer.chunks is not None:
        events = ResponseEvents(build, hexid, logprobs=rs.LOGPROBS_INCLUDE in (req.include or []))
        return answer.restream(lambda chunks: response_events(chunks, events, store))
    if answer.completion is None:
        return answer.response
    return await _answer(answer, build, hexid, store)


async def _answer(answer: ChatAnswer, build: Any, hexid: str, store: Any) -> JSONResponse:
    assert answer.completion is not None
    choice = answer.completion["choices"][0]
    message = choice["message"]
    logprobs = (choice.get("logprobs") or {}).get("content")
    await store(message)
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    usage = answer.completion["usage"]
    body = build(
        status=status,
        output=ro.output_items(hexid, message, logprobs),
        usage_obj=ro.usage(usage["prompt_tokens"], usage["completion_tokens"]),
        created_at=float(answer.completion["created"]),
    )
    body["hindsight"] = answer.completion.get("hindsight")
    return JSONResponse(body, headers=hindsight_headers(answer))
