"""The chat route, ``/v1/chat/completions`` (thin): key check, body, session headers, validation, then
policy_server.api.chat.answer answers it (through policy_server.serving.chat_turn's turn).

Session protocol: ``X-Session-Id``, ``X-Turn-Type: main|side``, ``X-Session-Done``
headers, with body fallbacks ``session_id``/``turn_type``/``session_done`` removed before use. The
default turn type is ``default_turn_type``. Which session a request belongs to, also without these headers
(stock clients' hints, transcript inference), is policy_server.serving.identity's one precedence
(:func:`request_session`); which header-less requests are side is policy_server.serving.side_rules. Main
turns are recorded and paired, side turns recorded as side; the record is committed before the client
receives the end of the answer (the final chunk when streaming).

Hostile input (docs/CONTRACTS.md "Hostile input"): the body's size was bounded while it was read
(engine.http_guard, before this route and its auth); here it is parsed with nesting and surrogate checks,
a prompt that cannot fit the engine's context is refused before any per-message work, and the typed
shapes of openai_schemas.ChatRequest are checked, all as 400s that name the field and never echo it.
Nothing is recorded for a request that is refused. ``X-Session-Id`` is read as UTF-8.

Client disconnects and what becomes of an answer nobody receives: policy_server.api.chat.answer and
policy_server.serving.undelivered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from engine.observability import valid_session_id
from engine.validation import bool_word, clip, most_specific_error
from policy_server.api import model_names
from policy_server.api import openai_fields as fields
from policy_server.api import openai_schemas as oa
from policy_server.api.auth import require_client
from policy_server.api.bodies import read_json_object
from policy_server.api.chat.answer import ChatCall, ChatReply
from policy_server.api.response_models import ChatCompletion
from policy_server.api.route_docs import error_responses, json_request_body
from policy_server.errors import InvalidRequest
from policy_server.serving.chat_turn import ChatInput
from policy_server.serving.identity import SessionHint, session_hint
from policy_server.serving.opt_out import BadTrainHeader, train_choice
from policy_server.serving.undelivered import DISCONNECT_REASON as DISCONNECT_REASON
from policy_server.serving.undelivered import reject_turn as _reject_turn  # noqa: F401  # tests reach it here
from policy_server.state import PolicyState

router = APIRouter()

CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "chat.completion, or with stream: true chat.completion.chunk events",
        "model": ChatCompletion,
        "content": {"text/event-stream": {}},
    },
    **error_responses(400, 401, 404, 413, 415, 429, 502, 503, 504),
}


def _state(request: Request) -> PolicyState:
    return request.app.state.policy


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean, or a yes/no word by engine.validation.bool_word; anything else (an empty header
    included: a header that is sent must say which) is a 400."""
    if isinstance(value, bool):
        return value
    parsed = bool_word(str(value))
    if parsed is None:
        raise InvalidRequest(f"{name} must be one of true/false/1/0/yes/no/on/off, got {clip(value)}", param=name)
    return parsed


def _utf8_header(request: Request, name: str) -> str | None:
    """A header as UTF-8 text (HTTP stacks hand headers over as latin-1: ``café`` would become ``cafÃ©``)."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise InvalidRequest(f"{name} must be UTF-8 text", param=name) from None


def session_info(request: Request, body: dict[str, Any], default_turn_type: str) -> tuple[str | None, str, bool]:
    """(session_id, turn_type, session_done) from headers, else the (removed) body fallbacks."""
    fallbacks = {k: body.pop(k) for k in oa.SESSION_BODY_KEYS if k in body}
    if not isinstance(fallbacks.get("session_id", ""), str):
        raise InvalidRequest("session_id must be a string", param="session_id")
    sid = _utf8_header(request, "x-session-id")
    if sid is None:
        sid = fallbacks.get("session_id")
    if sid is not None:
        sid = valid_session_id(sid)
        if sid is None:
            raise InvalidRequest("X-Session-Id must be 1-256 printable characters", param="X-Session-Id")
    turn_type = str(request.headers.get("x-turn-type", fallbacks.get("turn_type", default_turn_type))).strip().lower()
    if turn_type not in ("main", "side"):
        raise InvalidRequest(f"X-Turn-Type must be main or side, got {clip(turn_type)}", param="X-Turn-Type")
    done = _flag(request.headers.get("x-session-done", fallbacks.get("session_done", False)), "X-Session-Done")
    return sid, turn_type, done


def request_session(
    request: Request, body: dict[str, Any], default_turn_type: str
) -> tuple[SessionHint, str, bool, bool]:
    """(session hint, turn type, whether the client typed the turn, session done): the session part of any
    chat-shaped request. Every route calls this one function, so the precedence of
    policy_server.serving.identity holds for all of them."""
    typed = "x-turn-type" in request.headers or "turn_type" in body
    sid, turn_type, done = session_info(request, body, default_turn_type)
    hint = session_hint(request.headers, body, sid)
    try:
        train = train_choice(request.headers, hint.key)
    except BadTrainHeader as exc:
        raise InvalidRequest(str(exc), param="X-Hindsight-Train") from None
    return dataclasses.replace(hint, train=train), turn_type, typed, done


def _chat_input(
    st: PolicyState,
    body: dict[str, Any],
    hint: SessionHint,
    turn_type: str,
    done: bool,
    typed: bool,
    id_prefix: str = "chatcmpl-",
) -> ChatCall:
    """The typed request, its messages and the engine's sampling params; every problem a 400 naming its field.
    The answer's id is ``id_prefix`` + hex."""
    if isinstance(body.get("messages"), list):  # a hopeless prompt is refused before any per-message work
        tools = body.get("tools")
        st.generator.check_fits(
            [m for m in body["messages"] if isinstance(m, dict)], tools if isinstance(tools, list) else None
        )
    try:
        req = oa.ChatRequest.model_validate(body)
    except ValidationError as exc:
        message, param = most_specific_error(exc.errors())
        raise InvalidRequest(message, param=param) from None
    model_names.check_model(st.settings, req.model)
    fields.check_stream_options(req)
    messages = oa.validate_messages(req.messages)
    oa.validate_tools(req.tools, req.tool_choice)
    extras = fields.parse_extras(body)
    sp = oa.sampling_params(req, st.settings.default_max_tokens, st.settings.default_temperature)
    forced = fields.apply_constraints(extras, sp, req.tools, req.tool_choice, st.generator.family.tool_call_parser)
    tools_active = bool(req.tools) and req.tool_choice != "none"
    fields.apply_extras(
        extras,
        sp,
        vocab_size=len(st.generator.tokenizer),
        forced_tools=forced,
        tools=tools_active,
        behind_router=st.settings.engine_url not in st.settings.engine_worker_urls,
        keep_special_tokens=st.generator.family.keeps_special_tokens(tools_active),
    )
    turn = ChatInput(
        messages=messages,
        tools=req.tools,
        template_kwargs=fields.chat_template_kwargs(extras, st.generator.family.reasoning_switch),
        top_logprobs_num=extras.top_logprobs or 0,
        sp=sp,
        forced=forced,
        sid=hint.key,
        turn_type=turn_type,
        done=done,
        id_prefix=id_prefix,
        hint=hint,
        typed=typed,
    )
    return ChatCall(req=req, extras=extras, turn=turn)


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_request_body(fields.chat_request_schema()),
    responses=CHAT_RESPONSES,
)
async def chat_completions(request: Request) -> Response:
    st = _state(request)
    require_client(request, st.settings)
    body = await read_json_object(request, st.settings.max_json_depth)
    hint, turn_type, typed, done = request_session(request, body, st.settings.default_turn_type)
    reply = await ChatReply.begin(st, _chat_input(st, body, hint, turn_type, done, typed))
    return await reply.respond(request)
