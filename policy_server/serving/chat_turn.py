"""One chat turn from a validated request to its record: session, render, generation, record, cleanup.

:meth:`ChatTurn.begin` takes a :class:`ChatInput` (validated by the API layer) and does what must happen
before generating: the backlog check (a main turn is refused with 429 while the store holds too many
unconsumed samples), the session's arrival (or the inferred session's claim) and the prompt's render. A
render that fails still writes the pairing the request owes. The API layer (policy_server.api.chat.answer)
then generates through ``st.generator`` with the turn's ``prompt_ids``, ``sp`` and ``res``, and answers as
JSON or SSE. Opted-out requests (policy_server.serving.opt_out) are served as side turns (``off``) or
recorded nowhere (``none``); secrets are redacted out of every record before it is stored
(policy_server.serving.secrets). Only main turns of a session are recorded (:meth:`ChatTurn.finish_turn`); the record is
committed before the client receives the end of the answer (the final chunk when streaming). A client
that leaves, or an engine that fails, ends the turn through policy_server.serving.undelivered
(:meth:`ChatTurn.engine_failed`, :meth:`ChatTurn.abandon_stream`). Nothing here knows an API shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from engine.errors import EngineError
from engine.records import TurnRecord
from engine.tool_grammar import is_constrained
from policy_server.errors import Backpressure
from policy_server.serving.generation import GenResult
from policy_server.serving.identity import HEADER, INFERRED, Identity, SessionHint
from policy_server.serving.opt_out import NONE, OFF, ON, OPT_OUT_RULE
from policy_server.serving.secrets import Redacted, redact_record
from policy_server.serving.sessions import Arrival
from policy_server.serving.side_rules import HEADER_RULE
from policy_server.serving.turn_state import ServingState
from policy_server.serving.undelivered import abandon_detached, engine_failed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatInput:
    """What the serving layer needs of a chat request the API layer validated, with its session headers."""

    messages: list[dict[str, object]]  # validated, in the shape the chat template renders
    tools: list[dict[str, object]] | None  # the request's tool definitions (rendered, and kept in the record)
    template_kwargs: dict[str, object] | None  # chat template switches (e.g. thinking off), also for the teacher
    top_logprobs_num: int  # alternatives per token the engine reports (the client's top_logprobs)
    sp: dict[str, object]  # the engine's sampling params, any grammar included
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
    # The messages pairing and session choice compare (None: ``messages``). A Responses chain compares its
    # conversation under the instructions of the turn it continues: instructions belong to one request only.
    # Set only when it differs from ``messages``; the prompt is then a full render, never a continuation.
    transcript: list[dict[str, object]] | None = None


async def check_backlog(st: ServingState) -> None:
    """Backpressure (429 with Retry-After) while the store holds ``max_unconsumed_samples`` or more unconsumed samples."""
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
    messages: list[dict[str, object]],
    tools: list[dict[str, object]] | None,
    res: GenResult,
    message: dict[str, object],
    sp: dict[str, object],
    template_kwargs: dict[str, object] | None,
    response_id: str | None = None,
    identity: Identity | None = None,
) -> TurnRecord:
    """The turn's :class:`~engine.records.TurnRecord`, as the store persists it; ``response_id`` is the
    id the client got for the reply (explicit feedback names the turn by it).

    The two fields that grow with the history (engine.records.TURN_HISTORY_FIELDS) are validated where they
    are made, the request's messages by the API layer and the prompt ids by the renderer: the record is
    validated with an empty stand-in of each and then carries the originals (a copy with an update is not
    validated again), so a 30k-token turn is not walked once more by validation."""
    record = TurnRecord(
        chat_template_kwargs=template_kwargs,  # the teacher renders its prompt the same way
        messages=[],
        tools=tools,
        prompt_ids=[],
        response_ids=res.response_ids,
        rollout_logprobs=res.logprobs,
        # The engine's finish type (stop, length) goes with the reply: the judge's ``truncated`` guard reads it.
        response={
            **{k: message.get(k) for k in ("content", "reasoning_content", "tool_calls")},
            "finish_reason": res.finish.get("type"),
        },
        weight_version=res.weight_version,
        weight_versions=res.weight_versions,
        sampling_params=sp,
        # A forced tool call or a JSON response format decodes under a grammar: the log-probs are the
        # masked distribution's.
        constrained=is_constrained(sp),
        response_id=response_id,
        session_rule=identity.rule if identity is not None else None,
        session_decision=identity.decision if identity is not None else None,
    )
    return record.model_copy(update={"messages": messages, "prompt_ids": res.prompt_ids})


class ChatTurn:
    """One chat request after its prompt is rendered, answered once by the API layer.

    ``sid``, ``res`` and ``record_task`` are what the disconnect cleanup reads
    (policy_server.serving.undelivered.TurnInFlight). Whatever way the request ends, the pairing its
    ``arrival`` owes is written: by the turn record, else by ``settle_later``.
    """

    def __init__(
        self,
        st: ServingState,
        chat: ChatInput,
        *,
        sid: str | None,
        record: bool,
        arrival: Arrival | None,
        template_kwargs: dict[str, object] | None,
        prompt_ids: list[int],
        identity: Identity | None = None,
        side_rule: str | None = None,
        redacted: Redacted | None = None,
    ) -> None:
        self.st, self.chat, self.sid, self.record, self.arrival = st, chat, sid, record, arrival
        self.identity, self.side_rule = identity, side_rule
        # The arrival's redaction of the transcript: the record's messages when the transcript is the messages.
        self.redacted = redacted
        self.template_kwargs, self.prompt_ids = template_kwargs, prompt_ids
        hexid = uuid.uuid4().hex
        self.rid = f"{chat.id_prefix}{hexid}"
        # Engine rids "hs-<hex>-<segment>": unique per submission, one abort prefix per chat request.
        # The rendered ids, shared (not copied): neither the turn nor its result changes them.
        self.res = GenResult(prompt_ids=prompt_ids, rid_prefix=f"hs-{hexid}-", top_logprobs_num=chat.top_logprobs_num)
        self.record_task: asyncio.Task[int] | None = None  # the turn record on its way into the store
        # A session that keeps this turn's text gets the token that deletes it (serving.deletion_tokens).
        tokens = st.deletion_tokens
        self.deletion_token = tokens.token(sid) if tokens is not None and sid is not None else None

    @classmethod
    async def begin(cls, st: ServingState, chat: ChatInput) -> ChatTurn:
        """Side rules, backlog check, the session (policy_server.serving.identity) and the render: the turn,
        ready to generate."""
        hint = chat.hint or (SessionHint(chat.sid, HEADER) if chat.sid is not None else SessionHint(None, INFERRED))
        side_rule = None
        if hint.train == OFF:
            side_rule = OPT_OUT_RULE
        elif chat.turn_type == "side":
            side_rule = HEADER_RULE if chat.typed else "default_turn_type"
        elif not chat.typed and st.side_rules is not None:
            side_rule = st.side_rules.match(chat.messages)
        main = side_rule is None and hint.train == ON
        assert st.resolver is not None
        if main and (hint.key is not None or hint.previous_response_id is not None or st.resolver.inferrer):
            await check_backlog(st)
        transcript = chat.messages if chat.transcript is None else chat.transcript
        redacted = None
        if st.secrets is not None and hint.train != NONE:
            # Pairing and session choice compare the transcript as the store keeps it: redacted the same way. The
            # record reuses this redaction for its messages when they are the transcript (redact_record checks).
            redacted = await asyncio.to_thread(st.secrets.redact_transcript, transcript)
            transcript = redacted.value
        secret = redacted is not None and bool(redacted.kinds)
        if hint.train == NONE:  # store nothing: not even the session's row
            ident = Identity(None, None, OPT_OUT_RULE, NONE)
        else:
            ident = await st.resolver.resolve(hint, transcript, main=main, done=chat.done)
        record = main and ident.sid is not None
        st.metrics.turns.labels(turn_type="main" if record else "side").inc()
        if side_rule is not None:
            st.metrics.side_turns.labels(rule=side_rule).inc()
        if hint.train != ON:
            st.metrics.opted_out.labels(train=hint.train).inc()
        template_kwargs = chat.template_kwargs
        # The paired turn's ids are continued only when the pairing compared the messages the model sees: under
        # another transcript (other instructions) the prompt's start differs from that turn's, so it is rendered
        # in full (engine.continuation trusts the pairing for the history it continues). A prompt holding a secret
        # is rendered in full too: the turn it continues was stored without ids.
        prior = ident.arrival.prior if ident.arrival is not None and chat.transcript is None and not secret else None
        try:
            rendered = await st.generator.render(chat.messages, chat.tools, template_kwargs, prior)
        except BaseException:
            st.sessions.settle_later(ident.arrival)  # refused before generating: the pairing it owes is written anyway
            raise
        st.metrics.prompt_renders.labels(reason=rendered.reason).inc()
        st.metrics.prompt_tokens.labels(kind="reused").inc(rendered.reused_tokens)
        st.metrics.prompt_tokens.labels(kind="rendered").inc(len(rendered.ids) - rendered.reused_tokens)
        prompt_ids = rendered.ids
        turn = cls(
            st,
            chat,
            sid=ident.sid,
            record=record,
            arrival=ident.arrival,
            template_kwargs=template_kwargs,
            prompt_ids=prompt_ids,
            identity=ident,
            side_rule=side_rule,
            redacted=redacted,
        )
        if record and st.canary is not None:  # a main turn goes to its session's version (safe updates)
            turn.res.engine = await st.canary.engine_for(ident.sid)
        return turn

    async def finish_turn(self, res: GenResult, message: dict[str, object]) -> None:
        """Count resumes and, for a recorded turn, commit its record before the client gets the end."""
        st, chat = self.st, self.chat
        st.metrics.resumes.inc(res.resumes)
        st.metrics.prompt_tokens.labels(kind="cached").inc(res.cached_tokens or 0)
        if self.record:
            assert self.sid is not None
            record, kinds = await asyncio.to_thread(
                redact_record,
                st.secrets,
                turn_record(
                    chat.messages, chat.tools, res, message, chat.sp, self.template_kwargs, self.rid, self.identity
                ),
                self.redacted,
            )
            self.record_task = asyncio.ensure_future(
                st.sessions.on_main_turn(self.sid, record, done=chat.done, arrival=self.arrival, redacted=kinds)
            )
            # Shielded: a disconnect now must not lose track of a write that commits anyway (see undelivered).
            await asyncio.shield(self.record_task)
        elif self.side_rule is not None:
            record = turn_record(chat.messages, chat.tools, res, message, chat.sp, self.template_kwargs)
            try:  # kept for operators; a failed write must not fail an answer that trains nothing
                record, kinds = await asyncio.to_thread(redact_record, st.secrets, record, self.redacted)
                await asyncio.shield(
                    asyncio.to_thread(st.store.record_side_turn, self.sid, self.side_rule, record, redacted=kinds)
                )
            except Exception:
                logger.exception("recording a side turn (rule %s) failed", self.side_rule)

    def engine_failed(self, exc: EngineError) -> None:
        """The engine failed this turn: counted; a timed-out generation is abandoned (undelivered)."""
        engine_failed(self.st, self, exc)

    def abandon(self, why: str) -> asyncio.Task[None]:
        """The client will not get this answer: abort it upstream and keep it out of training, detached
        (the caller may be being cancelled; policy_server.serving.undelivered)."""
        return abandon_detached(self.st, self, why)

    def abandon_stream(self, deltas: AsyncGenerator[str, None]) -> None:
        """A stream that did not get to its end: the same, closing the engine stream first. Called from the
        SSE body's ``finally``, cancelled at an await or closed at a yield: it must not await. An
        EngineTimeout may have abandoned the turn already."""
        if not self.res.abandoned:
            abandon_detached(self.st, self, "client disconnected mid-stream", close=deltas)

    def settle(self) -> None:
        """However the request ends, the pairing its arrival owes is written (at the latest now)."""
        self.st.sessions.settle_later(self.arrival)
