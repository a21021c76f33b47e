"""Client routes: ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/ready``, ``/metrics`` (thin).

Session protocol: ``X-Session-Id``, ``X-Turn-Type: main|side``, ``X-Session-Done``
headers, with body fallbacks ``session_id``/``turn_type``/``session_done`` removed before use. The
default turn type is ``default_turn_type``. A request without a session id is served and not recorded
(nothing could ever pair it), unless session inference is on (policy_server.serving.session_inference). Only main
turns are recorded; the record is committed before the client receives the end of the answer (the final
chunk when streaming).

Hostile input (docs/CONTRACTS.md "Hostile input"): the body's size was bounded while it was read
(engine.http_guard, before this route and its auth); here it is parsed with nesting and surrogate checks,
a prompt that cannot fit the engine's context is refused before any per-message work, and the typed
shapes of openai_schemas.ChatRequest are checked, all as 400s that name the field and never echo it.
Nothing is recorded for a request that is refused. ``X-Session-Id`` is read as UTF-8.

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

Then :func:`_abandon` marks the generation abandoned (an abort that comes back is never resumed, see
policy_server.serving.generation), sends ``abort_request(rid prefix)`` to every engine worker (best effort, short
timeout, logged) and keeps the turn out of training: a reply the client did not get in full is never
recorded; if the disconnect hit while the record was being written (one transaction in a worker thread:
it commits whole or not at all) the record is awaited and then resolved ``mismatch`` with its sample
``rejected`` (``reject_reason`` ``client_disconnected``), since the client's next request cannot contain
it. "Delivered" means the stream got to ``data: [DONE]`` (the non-streaming JSON body was handed over).
A generation that ends in an EngineTimeout is aborted the same way (the engine may still be running it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from engine.chat import DEFAULT_TOOL_PARSER, parse_assistant_output
from engine.disconnect import (
    CLIENT_CLOSED_STATUS,
    ClientGone,
    abort_engine_requests,
    unless_disconnected,
)
from engine.errors import EngineError, EngineTimeout
from engine.http_guard import BadJSON, parse_json_body
from engine.observability import valid_session_id
from engine.records import RejectReason, TurnRecord
from engine.validation import most_specific_error
from policy_server.api import openai_fields as fields
from policy_server.api import openai_schemas as oa
from policy_server.api.auth import is_admin, require_client
from policy_server.api.streaming import assistant_message, sse_events
from policy_server.errors import Backpressure, InvalidRequest
from policy_server.serving.generation import GenResult
from policy_server.serving.tool_choice import GRAMMAR_KEYS
from policy_server.state import PolicyState
from policy_server.store import SampleStore

logger = logging.getLogger(__name__)
router = APIRouter()
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
DISCONNECT_REASON = RejectReason.CLIENT_DISCONNECTED
_cleanups: set[asyncio.Task[None]] = set()  # strong refs: a detached cleanup must not be garbage-collected


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
        raise InvalidRequest(f"X-Turn-Type must be main or side, got {turn_type!r}", param="X-Turn-Type")
    done = _flag(request.headers.get("x-session-done", fallbacks.get("session_done", False)), "X-Session-Done")
    return sid, turn_type, done


async def _read_json(request: Request, max_depth: int) -> dict[str, Any]:
    """The JSON object body. Its size was bounded while reading (engine.http_guard.BodyLimitMiddleware);
    deep nesting and unpaired surrogates are a 400 here, before any template or tokenizer sees them."""
    try:
        body = parse_json_body(await request.body(), max_depth=max_depth)
    except BadJSON as exc:
        raise InvalidRequest(str(exc)) from None
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
        raise Backpressure(
            f"sample store holds {int(value)} unconsumed samples (limit "
            f"{st.settings.max_unconsumed_samples}); the trainer must lease/ack before new main turns"
        )


def _turn_record(
    messages: list[dict[str, Any]],
    tools: Any,
    res: GenResult,
    message: dict[str, Any],
    sp: dict[str, Any],
    template_kwargs: dict[str, Any] | None,
) -> dict[str, Any]:
    """The turn's :class:`~engine.records.TurnRecord` JSON, as the store persists it."""
    return TurnRecord(
        chat_template_kwargs=template_kwargs,  # the teacher renders its prompt the same way
        messages=messages,
        tools=tools,
        prompt_ids=res.prompt_ids,
        response_ids=res.response_ids,
        rollout_logprobs=res.logprobs,
        response={k: message.get(k) for k in ("content", "reasoning_content", "tool_calls")},
        weight_version=res.weight_version,
        weight_versions=res.weight_versions,
        sampling_params=sp,
        # A forced tool call or a JSON response format decodes under a grammar: the log-probs are the
        # masked distribution's.
        constrained=any(k in sp for k in GRAMMAR_KEYS),
    ).to_json()


@dataclass
class _Turn:
    """One chat request as the disconnect cleanup sees it (see :func:`_abandon`)."""

    sid: str | None
    res: GenResult
    record_task: asyncio.Task[int] | None = None  # the turn record on its way into the store


def _reject_turn(store: SampleStore, sid: str, turn_index: int) -> str:
    """Keep a recorded but undelivered turn out of training (worker thread): which outcome applied."""
    note = "client disconnected before the reply was delivered"
    if (
        store.resolve_turn(
            sid,
            turn_index,
            pairing="mismatch",
            next_state=None,
            session_done=False,
            note=note,
            reject_reason=DISCONNECT_REASON,
        )
        is not None
    ):
        return "rejected"
    # Already resolved: the request ended its session (or the idle sweep did), so its sample was created
    # pending_judge in the same transaction; reject it unless the judge has decided it in the meantime.
    for row in store.list_samples(session_id=sid, status="pending_judge", limit=10_000):
        if row["turn_index"] == turn_index and store.complete_judge(
            row["sample_id"], status="rejected", reject_reason=DISCONNECT_REASON, included=False, data=None
        ):  # no Sample JSON, like every pairing rejection
            return "rejected"
    return "already decided"


async def _abandon(st: PolicyState, turn: _Turn, why: str) -> None:
    """The client will not get (all of) this answer: abort it upstream and keep it out of training."""
    turn.res.abandoned = True
    logger.info(
        "%s: aborting engine requests %s* (%d token(s) generated)", why, turn.res.rid_prefix, len(turn.res.response_ids)
    )
    await abort_engine_requests(st.weight_sync.workers, turn.res.rid_prefix)
    if turn.record_task is None or turn.sid is None:
        return
    try:
        idx = await turn.record_task
    except Exception:  # the record failed as a whole: nothing was written
        logger.exception("turn record failed while its client disconnected")
        return
    outcome = await asyncio.to_thread(_reject_turn, st.store, turn.sid, idx)
    logger.info(
        "session %s turn %d was recorded as the client disconnected: %s (%s)", turn.sid, idx, outcome, DISCONNECT_REASON
    )


def _abandon_detached(
    st: PolicyState, turn: _Turn, why: str, *, close: AsyncGenerator[str, None] | None = None
) -> asyncio.Task[None]:
    """Run :func:`_abandon` as its own task: it must finish even when the caller is being cancelled."""
    turn.res.abandoned = True  # at once, before any await: nothing may resubmit from here on

    async def run() -> None:
        if close is not None:
            await close.aclose()  # stop reading the engine stream first
        await _abandon(st, turn, why)

    task = asyncio.create_task(run(), name=f"abandon-{turn.res.rid_prefix}")
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    return task


async def _first_delta(deltas: AsyncIterator[str]) -> str | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


def _engine_failed(st: PolicyState, turn: _Turn, exc: EngineError) -> None:
    st.metrics.engine_errors.labels(kind=type(exc).__name__).inc()
    if isinstance(exc, EngineTimeout):  # we stopped waiting; the engine may still be generating it
        _abandon_detached(st, turn, "engine call timed out")


@router.post(
    "/v1/chat/completions",
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": oa.chat_request_schema()}}}
    },
    responses=oa.CHAT_RESPONSES,
)
async def chat_completions(request: Request) -> Response:
    st = _state(request)
    require_client(request, st.settings)
    body = await _read_json(request, st.settings.max_json_depth)
    sid, turn_type, done = session_info(request, body, st.settings.default_turn_type)
    if isinstance(body.get("messages"), list):  # a hopeless prompt is refused before any per-message work
        st.generator.check_fits([m for m in body["messages"] if isinstance(m, dict)])
    try:
        req = oa.ChatRequest.model_validate(body)
    except ValidationError as exc:
        message, param = most_specific_error(exc.errors())
        raise InvalidRequest(message, param=param) from None
    messages = oa.validate_messages(req.messages)
    oa.validate_tools(req.tools, req.tool_choice)
    extras = fields.parse_extras(body)
    sp = oa.sampling_params(req, st.settings.default_max_tokens, st.settings.default_temperature)
    forced = fields.apply_constraints(extras, sp, req.tools, req.tool_choice)
    fields.apply_extras(
        extras,
        sp,
        vocab_size=len(st.generator.tokenizer),
        forced_tools=forced,
        tools=bool(req.tools) and req.tool_choice != "none",
        behind_router=st.settings.engine_url not in st.settings.engine_worker_urls,
    )
    infer = sid is None and turn_type == "main" and st.inferrer is not None
    record = (sid is not None or infer) and turn_type == "main"
    if record:
        await _check_backlog(st)
    if infer:
        assert st.inferrer is not None
        sid, arrival = await st.inferrer.claim(messages, done=done)  # claims the session it continues
    else:
        arrival = await st.sessions.on_request(sid, messages, main=record, done=done) if sid is not None else None
    st.metrics.turns.labels(turn_type=turn_type if record else "side").inc()
    template_kwargs = fields.chat_template_kwargs(extras)
    try:
        prompt_ids = await st.generator.render(messages, req.tools, template_kwargs)
    except BaseException:
        st.sessions.settle_later(arrival)  # refused before generating: the pairing it owes is written anyway
        raise
    model = req.model or st.settings.served_model_name
    hexid = uuid.uuid4().hex
    rid = f"chatcmpl-{hexid}"
    parse_tools = req.tool_choice != "none"
    # Engine rids "hs-<hex>-<segment>": unique per submission, one abort prefix per chat request.
    turn = _Turn(
        sid=sid,
        res=GenResult(
            prompt_ids=list(prompt_ids), rid_prefix=f"hs-{hexid}-", top_logprobs_num=extras.top_logprobs or 0
        ),
    )

    def logprob_entries(start: int, end: int) -> list[dict[str, Any]]:
        r = turn.res
        return fields.token_logprobs(
            st.generator.tokenizer,
            r.response_ids[start:end],
            r.logprobs[start:end],
            r.top_logprobs[start:end] if r.top_logprobs_num else None,
        )

    async def finish_turn(res: GenResult, message: dict[str, Any]) -> None:
        st.metrics.resumes.inc(res.resumes)
        if record:
            assert sid is not None
            turn.record_task = asyncio.ensure_future(
                st.sessions.on_main_turn(
                    sid,
                    _turn_record(messages, req.tools, res, message, sp, template_kwargs),
                    done=done,
                    arrival=arrival,
                )
            )
            # Shielded: a disconnect now must not lose track of a write that commits anyway (see _abandon).
            await asyncio.shield(turn.record_task)

    async def answer() -> JSONResponse:
        res = await st.generator.generate(prompt_ids, sp, turn.res)
        parsed = parse_assistant_output(res.text, tool_parser=DEFAULT_TOOL_PARSER if parse_tools else None)
        # A forced call cut short (max_tokens) is no call and no content: its markup never reaches the client.
        content = None if forced and not parsed.tool_calls else parsed.content
        message = assistant_message(content, parsed.reasoning_content, parsed.tool_calls)
        await finish_turn(res, message)
        return JSONResponse(
            oa.completion(
                rid=rid,
                model=model,
                message=message,
                finish=oa.finish_reason(res.finish, bool(parsed.tool_calls)),
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(res.response_ids),
                logprobs={"content": logprob_entries(0, len(res.response_ids))} if extras.logprobs else None,
                metadata=extras.metadata,
                hindsight=fields.hindsight_extension(res.weight_version, sid),
            ),
            headers=fields.hindsight_headers(res.weight_version, sid),
        )

    include_usage = bool((req.stream_options or {}).get("include_usage"))
    deltas = st.generator.stream(prompt_ids, sp, turn.res) if req.stream else None
    streaming = False
    try:
        if deltas is None:
            return await unless_disconnected(request, answer())
        # The first delta is awaited before answering, so a down engine is a real 503, not a broken stream.
        first_delta = await unless_disconnected(request, _first_delta(deltas))
        streaming = True
    except ClientGone:
        await asyncio.shield(_abandon_detached(st, turn, "client disconnected before its answer"))
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except asyncio.CancelledError:
        _abandon_detached(st, turn, "chat request cancelled")
        raise
    except EngineError as exc:
        _engine_failed(st, turn, exc)
        raise
    finally:
        if not streaming:  # answered, failed or gone: the pairing this request owes is written now at the latest
            st.sessions.settle_later(arrival)

    def undelivered() -> None:
        # Cancelled at an await (Starlette saw http.disconnect) or closed at a yield (the background aclose).
        # Detached: awaiting here could be cancelled again. An EngineTimeout may have started it already.
        if not turn.res.abandoned:
            _abandon_detached(st, turn, "client disconnected mid-stream", close=deltas)

    events = sse_events(
        rid=rid,
        model=model,
        first=first_delta,
        deltas=deltas,
        res=turn.res,
        parse_tools=parse_tools,
        forced_call=bool(forced),
        logprob_entries=logprob_entries if extras.logprobs else None,
        include_usage=include_usage,
        finish_turn=finish_turn,
        on_engine_error=lambda e: _engine_failed(st, turn, e),
        on_undelivered=undelivered,
    )

    async def close_stream() -> None:
        try:
            await events.aclose()  # type: ignore[attr-defined]  # sse_events is an async generator
        finally:
            st.sessions.settle_later(arrival)

    # The background task runs after the body ends or the client left (Starlette cancels the body on
    # http.disconnect, then runs it): closing the iterator there runs its finally in every case.
    headers = {"Cache-Control": "no-cache", **fields.hindsight_headers(turn.res.weight_version, sid)}
    return StreamingResponse(
        events, media_type="text/event-stream", headers=headers, background=BackgroundTask(close_stream)
    )


@router.get("/v1/models", responses=oa.error_responses(401))
async def models(request: Request) -> dict[str, Any]:
    st = _state(request)
    require_client(request, st.settings)
    return {
        "object": "list",
        "data": [
            {
                "id": st.settings.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "hindsight",
                "weight_version": st.gate.version,
            }
        ],
    }


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "engine down, store busy or draining (same body)"}})
async def ready(request: Request) -> JSONResponse:
    """200 when the engine answers, the store can start a write now and the server is not draining, else 503.
    Anyone sees the three checks; the detail (engine URL, weight version, gate, why the store is busy) only
    the admin key's holder."""
    st = _state(request)
    draining = request.app.state.drain.draining
    engine_ok = await st.engine.health(timeout_s=2.0)
    store_problem = await asyncio.to_thread(st.store.probe, min(0.5, st.settings.store_busy_timeout_s))
    ok = not draining and engine_ok and store_problem is None
    body: dict[str, Any] = {"ready": ok, "engine": engine_ok, "store": store_problem is None, "draining": draining}
    if is_admin(request, st.settings):
        body.update(
            engine_url=st.settings.engine_url,
            weight_version=st.gate.version,
            gate_open=st.gate.is_open,
            judge=bool(st.pipeline),
            store_detail=store_problem,
        )
    return JSONResponse(body, status_code=200 if ok else 503, headers={} if ok else {"Retry-After": "5"})


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain; version=0.0.4": {}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    st = _state(request)
    st.metrics.gate_waiting.set(st.gate.waiting)
    stats = await asyncio.to_thread(st.store.stats)
    return Response(st.metrics.render(stats), media_type="text/plain; version=0.0.4")
