"""Client routes: ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/ready``, ``/metrics`` (thin).

Session protocol (issue 4 item 3): ``X-Session-Id``, ``X-Turn-Type: main|side``, ``X-Session-Done``
headers, with body fallbacks ``session_id``/``turn_type``/``session_done`` removed before use. The
default turn type is ``default_turn_type``. A request without a session id is served and not recorded
(nothing could ever pair it). Only main turns are recorded; the record is committed before the client
receives the end of the answer (the final chunk when streaming).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from engine.chat import DEFAULT_TOOL_PARSER, parse_assistant_output
from engine.errors import EngineError
from policy_server import openai_schemas as oa
from policy_server.app import PolicyState
from policy_server.auth import require_client
from policy_server.errors import (
    Backpressure, InvalidRequest, PayloadTooLarge, PolicyError, engine_error_status, error_body,
)
from policy_server.generation import GenResult
from policy_server.streaming import StreamSplitter
from policy_server.tool_choice import forced_tool_regex

router = APIRouter()
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _state(request: Request) -> PolicyState:
    return request.app.state.policy


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise InvalidRequest(f"{name} must be one of true/false/1/0/yes/no, got {value!r}", param=name)


def session_info(request: Request, body: dict[str, Any], default_turn_type: str) -> tuple[str | None, str, bool]:
    """(session_id, turn_type, session_done) from headers, else the (removed) body fallbacks."""
    fallbacks = {k: body.pop(k) for k in oa.SESSION_BODY_KEYS if k in body}
    sid = request.headers.get("x-session-id", fallbacks.get("session_id"))
    if sid is not None:
        sid = str(sid)
        if not sid or len(sid) > 256 or not sid.isprintable():
            raise InvalidRequest("X-Session-Id must be 1-256 printable characters", param="X-Session-Id")
    turn_type = str(request.headers.get("x-turn-type", fallbacks.get("turn_type", default_turn_type))).strip().lower()
    if turn_type not in ("main", "side"):
        raise InvalidRequest(f"X-Turn-Type must be main or side, got {turn_type!r}", param="X-Turn-Type")
    done = _flag(request.headers.get("x-session-done", fallbacks.get("session_done", False)), "X-Session-Done")
    return sid, turn_type, done


async def _read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > max_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


async def _check_backlog(st: PolicyState) -> None:
    value, at = st.backlog_cache
    if time.monotonic() - at > 1.0:  # one COUNT per second at most, not per request
        value = float(await asyncio.to_thread(st.store.unconsumed_backlog))
        st.backlog_cache[:] = [value, time.monotonic()]
    if value >= st.settings.max_unconsumed_samples:
        st.metrics.backpressure.inc()
        raise Backpressure(f"sample store holds {int(value)} unconsumed samples (limit "
                           f"{st.settings.max_unconsumed_samples}); the trainer must lease/ack before new main turns")


def _turn_record(messages: list[dict[str, Any]], tools: Any, res: GenResult, message: dict[str, Any],
                 sp: dict[str, Any]) -> dict[str, Any]:
    return {"messages": messages, "tools": tools, "prompt_ids": res.prompt_ids, "response_ids": res.response_ids,
            "rollout_logprobs": res.logprobs, "response": {k: message.get(k) for k in
                                                            ("content", "reasoning_content", "tool_calls")},
            "weight_version": res.weight_version, "weight_versions": res.weight_versions, "sampling_params": sp,
            # A forced tool call decodes under a regex: the log-probs are the masked distribution's.
            "constrained": "regex" in sp}


def _message(content: str, reasoning: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = calls
    return msg


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = _state(request)
    require_client(request, st.settings)
    t0 = time.monotonic()
    body = await _read_json(request, st.settings.max_body_bytes)
    sid, turn_type, done = session_info(request, body, st.settings.default_turn_type)
    try:
        req = oa.ChatRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise InvalidRequest(f"{loc}: {first.get('msg')}", param=loc or None) from None
    messages = oa.validate_messages(req.messages)
    oa.validate_tools(req.tools, req.tool_choice)
    sp = oa.sampling_params(req, st.settings.default_max_tokens, st.settings.default_temperature)
    regex = forced_tool_regex(req.tools, req.tool_choice)
    if regex:
        sp["regex"] = regex
    record = sid is not None and turn_type == "main"
    if record:
        await _check_backlog(st)
    if sid is not None:
        await st.sessions.on_request(sid, messages, main=record, done=done)
    st.metrics.turns.labels(turn_type=turn_type if record else "side").inc()
    prompt_ids = await st.generator.render(messages, req.tools)
    model = req.model or st.settings.served_model_name
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    parse_tools = req.tool_choice != "none"

    async def finish_turn(res: GenResult, message: dict[str, Any]) -> None:
        st.metrics.resumes.inc(res.resumes)
        if record:
            await st.sessions.on_main_turn(sid, _turn_record(messages, req.tools, res, message, sp), done=done)

    if not req.stream:
        try:
            res = await st.generator.generate(prompt_ids, sp)
        except EngineError as exc:
            st.metrics.engine_errors.labels(kind=type(exc).__name__).inc()
            raise
        parsed = parse_assistant_output(res.text, tool_parser=DEFAULT_TOOL_PARSER if parse_tools else None)
        message = _message(parsed.content, parsed.reasoning_content, parsed.tool_calls)
        await finish_turn(res, message)
        st.metrics.latency.labels(route="chat").observe(time.monotonic() - t0)
        return JSONResponse(oa.completion(
            rid=rid, model=model, message=message, finish=oa.finish_reason(res.finish, bool(parsed.tool_calls)),
            prompt_tokens=len(prompt_ids), completion_tokens=len(res.response_ids),
            weight_version=res.weight_version, session_id=sid))

    include_usage = bool((req.stream_options or {}).get("include_usage"))
    res = GenResult(prompt_ids=list(prompt_ids))
    deltas = st.generator.stream(prompt_ids, sp, res)
    try:
        # The first delta is awaited before answering, so a down engine is a real 503, not a broken stream.
        first: str | None = await anext(deltas)
    except StopAsyncIteration:
        first = None
    except EngineError as exc:
        st.metrics.engine_errors.labels(kind=type(exc).__name__).inc()
        raise
    events = _sse(st, rid, model, first, deltas, res, parse_tools, include_usage, finish_turn, t0)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _sse(st: PolicyState, rid: str, model: str, first: str | None, deltas: AsyncIterator[str], res: GenResult,
               parse_tools: bool, include_usage: bool, finish_turn: Any, t0: float) -> AsyncIterator[str]:
    created = int(time.time())

    def event(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def out(pairs: list[tuple[str, str]]) -> list[str]:
        return [event(oa.chunk(rid=rid, model=model, created=created,
                               delta={"reasoning_content" if k == "reasoning" else "content": t})) for k, t in pairs]

    splitter = StreamSplitter() if parse_tools else None
    try:
        yield event(oa.chunk(rid=rid, model=model, created=created, delta={"role": "assistant", "content": ""}))
        pending = [first] if first is not None else []
        while True:
            for text in pending:
                pairs = splitter.feed(text) if splitter else [("content", text)]
                for e in out(pairs):
                    yield e
            try:
                pending = [await anext(deltas)]
            except StopAsyncIteration:
                break
        calls: list[dict[str, Any]] = []
        if splitter:
            tail, calls = splitter.finish()
            for e in out(tail):
                yield e
            message = _message(splitter.content, splitter.reasoning or None, calls)
        else:
            message = _message(res.text, None, [])
        if calls:
            delta_calls = [{"index": i, "id": c["id"], "type": "function",
                            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                           for i, c in enumerate(calls)]
            yield event(oa.chunk(rid=rid, model=model, created=created, delta={"tool_calls": delta_calls}))
        await finish_turn(res, message)
        yield event(oa.chunk(rid=rid, model=model, created=created, delta={},
                             finish=oa.finish_reason(res.finish, bool(calls))))
        if include_usage:
            yield event(oa.chunk(rid=rid, model=model, created=created,
                                 usage_obj=oa.usage(len(res.prompt_ids), len(res.response_ids))))
        st.metrics.latency.labels(route="chat_stream").observe(time.monotonic() - t0)
    except (EngineError, PolicyError) as exc:
        status = engine_error_status(exc) if isinstance(exc, EngineError) else exc.status_code
        yield event(error_body(status, str(getattr(exc, "message", exc)), "upstream_error"))
    yield "data: [DONE]\n\n"


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    st = _state(request)
    require_client(request, st.settings)
    return {"object": "list", "data": [{"id": st.settings.served_model_name, "object": "model", "created": 0,
                                        "owned_by": "hindsight", "weight_version": st.gate.version}]}


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    st = _state(request)
    draining = request.app.state.drain.draining
    ok = not draining and await st.engine.health(timeout_s=2.0)
    body = {"ready": ok, "engine_url": st.settings.engine_url, "weight_version": st.gate.version,
            "gate_open": st.gate.is_open, "judge": bool(st.pipeline), "draining": draining}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = _state(request)
    st.metrics.gate_waiting.set(st.gate.waiting)
    stats = await asyncio.to_thread(st.store.stats)
    return Response(st.metrics.render(stats), media_type="text/plain; version=0.0.4")
