"""The Anthropic Messages route, ``POST /v1/messages`` (thin): an adapter onto the one chat turn.

Key check (``x-api-key``, as Anthropic's clients send it, or ``Authorization: Bearer``), body, the session
the chat route's way (headers, body fallbacks), the typed request (policy_server.api.messages.shapes), its
chat body; policy_server.api.chat_bridge answers it as one chat turn (same render, record, pairing,
judging, training as ``/v1/chat/completions``), and the answer is converted back: a ``message`` object, or
the Messages event stream (policy_server.api.messages.stream). ``POST /v1/messages/count_tokens`` answers
the prompt's token count (:func:`count_message_tokens`). Every error of these routes, and of any other path
under ``/v1/messages``, has Anthropic's error shape (policy_server.errors.ErrorShapeMiddleware).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from policy_server.api import openai_schemas as oa
from policy_server.api.auth import require_client_any_header
from policy_server.api.bodies import read_json_object
from policy_server.api.chat import routes
from policy_server.api.chat_bridge import engine_stop, hindsight_headers, request_session, run_chat_turn
from policy_server.api.messages import shapes as ms
from policy_server.api.messages.stream import message_events
from policy_server.api.response_models_shapes import MessageObject, TokenCount
from policy_server.api.route_docs import body_schema, json_request_body
from policy_server.serving.identity import NONE, SessionHint
from policy_server.state import PolicyState

router = APIRouter()
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = MESSAGES_PATH + "/count_tokens"

_ERROR = {"description": "Anthropic's error shape", "content": {"application/json": {}}}
MESSAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a message object, or with stream: true the Messages event stream",
        "model": MessageObject,
        "content": {"text/event-stream": {}},
    },
    **dict.fromkeys((400, 401, 413, 429, 502, 503, 504), _ERROR),
}


@router.post(
    MESSAGES_PATH,
    openapi_extra=json_request_body(oa.request_schema(ms.MessagesRequest)),
    responses=MESSAGES_RESPONSES,
)
async def create_message(request: Request) -> Response:
    st: PolicyState = request.app.state.policy
    require_client_any_header(request, st.settings)
    body = await read_json_object(request, st.settings.max_json_depth)
    session = request_session(request, st, body)
    req = ms.parse_request(body)
    answer = await run_chat_turn(request, st, ms.chat_body(req), session, id_prefix="msg_")
    turn = answer.turn
    mid = turn.rid

    def stop(finish: str | None) -> tuple[str, str | None]:
        return ms.stop_reason(finish, engine_stop(turn), req.stop_sequences)

    if answer.chunks is not None:
        start = ms.message_object(
            mid=mid,
            model=answer.model,
            content=[],
            stop=(None, None),
            usage={"input_tokens": len(turn.prompt_ids), "output_tokens": 0},
        )
        return answer.restream(lambda chunks: message_events(chunks, start, stop))
    if answer.completion is None:
        return answer.response
    choice = answer.completion["choices"][0]
    usage = answer.completion["usage"]
    body_out = ms.message_object(
        mid=mid,
        model=answer.model,
        content=ms.content_blocks(choice["message"]),
        stop=stop(choice["finish_reason"]),
        usage={"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    )
    body_out["hindsight"] = answer.completion.get("hindsight")
    return JSONResponse(body_out, headers=hindsight_headers(answer))


@router.post(
    COUNT_TOKENS_PATH,
    response_model=TokenCount,
    # No session fallbacks: a count is no turn of any session.
    openapi_extra=json_request_body(body_schema(ms.MessagesPrompt)),
    responses={**dict.fromkeys((400, 401, 404, 413, 429), _ERROR)},
)
async def count_message_tokens(request: Request) -> TokenCount:
    """The tokens ``/v1/messages`` would prefill for this request: the same conversion and validation, the
    same render (system, messages, tools, thinking switch, the assistant's generation prompt included), counted
    by the policy's tokenizer. Nothing is generated or recorded; session headers are ignored."""
    st: PolicyState = request.app.state.policy
    require_client_any_header(request, st.settings)
    body = await read_json_object(request, st.settings.max_json_depth)
    prompt = ms.parse_prompt(body)
    # Validated as /v1/messages validates it, with no session: nothing is generated or recorded.
    no_session = SessionHint(None, NONE)
    call = routes._chat_input(st, ms.prompt_body(prompt), no_session, turn_type="side", done=False, typed=True)
    rendered = await st.generator.render(call.turn.messages, call.turn.tools, call.turn.template_kwargs)
    return TokenCount(input_tokens=len(rendered.ids))
