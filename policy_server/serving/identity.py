"""Which session a request belongs to: one precedence for every client, header-aware or stock.

Role: the one place a chat request (whatever API shape it came in) gets its session. Precedence:

1. ``header``: ``X-Session-Id`` (or the body's ``session_id``), Hindsight's own protocol;
2. a hint a stock client sends anyway, first found wins: ``prompt_cache_key`` (OpenAI's cache key: OpenClaw
   sends its session id there when its provider compat ``supportsPromptCacheKey`` is on), the ``session_id``
   / ``x-session-affinity`` headers (OpenClaw's ``compat.sendSessionAffinityHeaders``), ``metadata.session_id``,
   then the Responses API's ``previous_response_id`` chain (resolved by :attr:`SessionResolver.previous_response_session`);
3. ``inferred``: no id at all: the open session whose recorded transcript the request extends
   (policy_server.serving.session_inference), unless ``infer_sessions`` is off (then ``none``: served, not recorded).

A client's key (from 1 or 2) names a *family* of sessions, not one: the key ``K`` itself and ``K~<12 hex>``.
A main request with key ``K`` continues the family's open session whose awaiting turn it extends (the
pairing rule, as inference uses it); when none does, it starts a new member instead of turning a stranger's
turn into ``history_mismatch``. That covers a static provider header shared by several conversations
(they diverge), a request after ``X-Session-Done`` and after an idle end (the family has no open session),
and concurrent conversations (a session with a main request in flight is never continued by another).
With ``split_diverged_sessions`` off a key names exactly one session again (a divergence is a mismatch).

Across a compaction. A main request that continues no session but pairs an awaiting turn across a compaction
(rule 3 of policy_server.serving.pairing: it ends with the recorded reply and feedback, the history before the
reply rewritten) pairs that turn and starts a new session (decision ``compacted``): the key's own
session when the key is new (OpenClaw's ``prompt_cache_key`` gets a new suffix at each compaction, ``id:0`` then
``id:1``), else a new member of the family. The summary breaks the token continuity and the transcript a
session's turns extend, so each side of a compaction is a session of its own. The turn is looked for in the
family first, then (the key being new after a compaction) among every open session's awaiting turn, the one
whose recorded messages the request kept most of winning, then one whose opening it kept, then the one whose id
shares the longest start with the key (``id:0`` for ``id:1``); that wider read is made only for a request that
holds an assistant message, not for a conversation's first request.

Each decision (``continued``, ``started``, ``diverged``, ``after_done``, ``concurrent``, ``tied``, ``compacted``) is counted
in ``hindsight_policy_session_identity_total{rule, decision}`` and kept with the turn (``session_rule`` /
``session_decision``, shown by ``GET /v1/samples``). Matching and claiming happen under one lock, so two
requests never claim the same session.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from engine.observability import valid_session_id
from engine.records import Turn
from policy_server.metrics import Metrics
from policy_server.serving.pairing import CompactionMatch
from policy_server.serving.session_inference import SessionInferrer, choose_session, find_compacted
from policy_server.serving.sessions import Arrival, SessionTracker
from policy_server.store import SampleStore

HEADER, PROMPT_CACHE_KEY, AFFINITY, METADATA = "header", "prompt_cache_key", "session_affinity", "metadata"
PREVIOUS_RESPONSE, INFERRED, NONE = "previous_response", "inferred", "none"
AFFINITY_HEADERS = ("session_id", "x-session-affinity")
FAMILY_SEP = "~"


@dataclass(frozen=True)
class SessionHint:
    """What a request says about its session: a key and the rule that gave it (``key`` None: no id)."""

    key: str | None
    rule: str
    previous_response_id: str | None = None
    train: str = "on"  # on | off | none: whether the request may become training data (serving.opt_out)


@dataclass
class Identity:
    """The resolved session of one request: ``arrival`` as from SessionTracker.on_request (main requests)."""

    sid: str | None
    arrival: Arrival | None
    rule: str
    decision: str


def _valid(value: object) -> str | None:
    return valid_session_id(value) if isinstance(value, str) else None


def session_hint(headers: Mapping[str, str], body: Mapping[str, object], explicit_sid: str | None) -> SessionHint:
    """The request's session key by the precedence of the module docstring (pure; ``body`` is not changed).

    ``explicit_sid`` is the validated ``X-Session-Id`` / body ``session_id``. A hint that is not a valid session
    id (1-256 printable characters) is skipped, never a 400: it is another protocol's field.
    """
    if explicit_sid is not None:
        return SessionHint(explicit_sid, HEADER)
    key = _valid(body.get("prompt_cache_key"))
    if key is not None:
        return SessionHint(key, PROMPT_CACHE_KEY)
    for name in AFFINITY_HEADERS:
        key = _valid(headers.get(name))
        if key is not None:
            return SessionHint(key, AFFINITY)
    metadata = body.get("metadata")
    key = _valid(metadata.get("session_id")) if isinstance(metadata, Mapping) else None
    if key is not None:
        return SessionHint(key, METADATA)
    prev = body.get("previous_response_id")
    if isinstance(prev, str) and prev:
        return SessionHint(None, PREVIOUS_RESPONSE, previous_response_id=prev)
    return SessionHint(None, INFERRED)


def in_family(session_id: str, key: str) -> bool:
    """Whether ``session_id`` is the key's session or one it split off (pure)."""
    return session_id == key or (
        session_id.startswith(key + FAMILY_SEP) and FAMILY_SEP not in session_id[len(key) + 1 :]
    )


class SessionResolver:
    """Resolves every request's session (one per server). ``previous_response_session`` maps a stored
    response id to its session (set by the Responses API route's owner; None: that rule never matches)."""

    def __init__(
        self,
        store: SampleStore,
        sessions: SessionTracker,
        metrics: Metrics,
        *,
        infer: bool,
        split_diverged: bool = True,
    ):
        self.store, self.sessions, self.metrics = store, sessions, metrics
        self.inferrer = SessionInferrer(store, sessions, metrics) if infer else None
        self.split_diverged = split_diverged
        self.previous_response_session: Callable[[str], Awaitable[str | None]] | None = None
        self._lock = asyncio.Lock()

    async def resolve(
        self, hint: SessionHint, messages: list[dict[str, object]], *, main: bool, done: bool
    ) -> Identity:
        """The session of a request; a main request's arrival must go to ``on_main_turn`` / ``settle_later``."""
        key, rule = hint.key, hint.rule
        if key is None and hint.previous_response_id is not None and self.previous_response_session is not None:
            key = await self.previous_response_session(hint.previous_response_id)
        if key is None:
            rule = INFERRED if main and self.inferrer is not None else NONE
        ident = await self._resolve(key, rule, messages, main=main, done=done)
        self.metrics.session_identity.labels(rule=ident.rule, decision=ident.decision).inc()
        return ident

    async def _resolve(
        self, key: str | None, rule: str, messages: list[dict[str, object]], *, main: bool, done: bool
    ) -> Identity:
        if key is None:
            if rule == INFERRED:
                assert self.inferrer is not None
                sid, arrival, decision = await self.inferrer.claim_with_outcome(messages, done=done)
                return Identity(sid, arrival, INFERRED, decision)
            return Identity(None, None, NONE, "unrecorded")
        if not main:  # a side request touches (or ends, with done) the family's latest open session
            sid = await asyncio.to_thread(self._latest_open, key)
            await self.sessions.on_request(sid, messages, main=False, done=done)
            return Identity(sid, None, rule, "side")
        if not self.split_diverged:
            arrival = await self.sessions.on_request(key, messages, main=True, done=done)
            paired = arrival is not None and arrival.resolution is not None
            return Identity(key, arrival, rule, "continued" if paired else "started")
        async with self._lock:
            sid, decision = await self._choose(key, messages)
            arrival = await self.sessions.on_request(sid, messages, main=True, done=done)
        return Identity(sid, arrival, rule, decision)

    async def _compacted(
        self, key: str, family_free: list[Turn], messages: list[dict[str, object]]
    ) -> tuple[Turn, CompactionMatch] | None:
        """The awaiting turn the request pairs across a compaction, with its match: the family's free turns
        first, then every other open session's; the caller holds the lock."""
        side_rules = self.sessions.side_rules
        # Filtered again: a turn may have been claimed (by inference, under its own lock) since the caller's read.
        # From here to the caller's claim nothing awaits once a turn is found, so the check and the claim are atomic.
        family_free = [t for t in family_free if not self.sessions.in_flight(t.session_id)]
        found = find_compacted(family_free, messages, side_rules)
        if found is None and any(m.get("role") == "assistant" for m in messages):
            others = await asyncio.to_thread(self.store.awaiting_open_turns)
            others = [
                t for t in others if not in_family(t.session_id, key) and not self.sessions.in_flight(t.session_id)
            ]
            found = find_compacted(others, messages, side_rules, key=key)
        return (found[0], found[1]) if found is not None else None

    async def _choose(self, key: str, messages: list[dict[str, object]]) -> tuple[str, str]:
        """(session id, decision) for a main request of ``key``'s family; the caller holds the lock."""
        awaiting = await asyncio.to_thread(self.store.awaiting_open_turns, family=key)
        awaiting = [t for t in awaiting if in_family(t.session_id, key)]
        free = [t for t in awaiting if not self.sessions.in_flight(t.session_id)]
        sid, tied = choose_session(free, messages, self.sessions.side_rules)
        if sid is not None:
            return sid, "tied" if tied else "continued"
        row = await asyncio.to_thread(self.store.session, key)
        key_busy = self.sessions.in_flight(key) or any(t.session_id == key for t in awaiting)
        compacted = await self._compacted(key, free, messages)
        if compacted is not None:
            # A compaction starts the conversation's next session; the turn before it gets its next state. The key's
            # own session when it is free: new, or only touched by side requests (OpenClaw's compaction summary call).
            free_key = not key_busy and (row is None or not row.done)
            new = key if free_key else f"{key}{FAMILY_SEP}{uuid.uuid4().hex[:12]}"
            turn, match = compacted
            self.sessions.pair_compacted(turn.session_id, turn.turn_index, match.pairing, new)
            return new, "compacted"
        if row is None and not key_busy:
            return key, "started"
        if row is not None and not row.done and not key_busy:
            return key, "continued"  # the key's session has no turn yet (only side requests touched it)
        if free:
            decision = "diverged"
        elif awaiting or self.sessions.in_flight(key):
            decision = "concurrent"
        else:
            decision = "after_done"
        return f"{key}{FAMILY_SEP}{uuid.uuid4().hex[:12]}", decision

    def _latest_open(self, key: str) -> str:
        open_ids = [sid for sid in self.store.open_family_sessions(key) if in_family(sid, key)]
        return open_ids[0] if open_ids else key
