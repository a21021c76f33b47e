"""Sessions, turns and next-state pairing.

Role: decide, for each main request, which earlier turn it answers and with what next state; end
sessions on ``X-Session-Done`` or after an idle timeout. State lives in the store, so pairing and
idle expiry survive restarts.

Pairing rule. Let the session's awaiting turn T have request messages ``M`` and
sampled assistant reply ``R``; a new *main* request of the same session has messages ``N``:

1. ``N`` extends T when ``N[:len(M)]`` equals ``M`` and ``N[len(M)]`` is an assistant message equal to
   ``R`` (messages are compared by role, text content with surrounding whitespace stripped, tool calls
   by function name and parsed JSON arguments, tool results by ``tool_call_id``; ``reasoning_content``
   is ignored because clients commonly drop it from the history). An assistant message's text is compared
   as its reader sees it: reasoning blocks written inline (``<think>…</think>``, ``<thinking>``,
   ``<thought>``, ``<reasoning>``) removed and whitespace runs collapsed, because agents such as OpenClaw
   hide those blocks and rejoin the pieces around them when they resend the reply. A recorded reply with
   nothing visible (no text and no tool calls: all reasoning) may be missing from ``N`` altogether, since
   clients drop empty assistant messages; then the next state follows ``M`` directly.
2. Then T's next state is ``N[len(M)+1:]``: one user reply, or one or more tool results (each typed by
   role), possibly followed by a user message. It must be non-empty and contain only ``user``/``tool``
   messages; a system/developer message appended by the client is not feedback on R and is dropped from
   the next state (recorded in the note). A side exchange the client kept in the transcript (a user message a side
   rule matches, e.g. an agent's memory flush, with its reply) is left out first (policy_server.serving.side_rules).
3. Across a compaction (:func:`pair_across_compaction`): a client that compacts its context (OpenClaw) replaces
   the early history with a summary and resends only a recent tail, so ``N`` no longer starts with ``M``. ``N``
   still pairs T when its last assistant message is ``R`` (compared as in 1; a reply with nothing visible cannot
   be found this way) and only user/tool feedback follows it (2 applies to it), whatever came before ``R``: a
   summary, a shorter tail, even another system prompt (OpenClaw rebuilds its own after a compaction, and may cut
   right at ``R``, summarising the message it answered as a "split turn"). The recorded reply is the evidence; how
   much more of ``M`` ``N`` kept (the messages right before ``R``, the opening message) ranks the candidates, in
   the session rules (policy_server.serving.identity), which also decide the session the request belongs to.
4. Anything else (history rewritten without the reply, reply edited, no new message) is a **mismatch**.
   Conservative decision: the pair cannot be trusted, so T is resolved as ``mismatch`` and its sample is
   **rejected** with reason ``history_mismatch`` (counted per session and in stats) instead of being
   judged against feedback that may belong to a different reply. The new request is served and recorded
   normally and starts a fresh pairing.

Commits (one per turn on the hot path): a main request's pairing is decided when it arrives (a read),
but written together with the turn it produces, in the same transaction (``Store.record_turn(resolve=)``).
When no turn gets recorded (engine failure, client gone) :meth:`SessionTracker.settle_later` writes the
pairing alone, so the answered turn is never stranded; the write is idempotent, so a race between the two
is harmless. While a main request of a session is in flight the idle sweep leaves that session alone
(its activity is refreshed when the turn is recorded, not at arrival); with replicas on a shared store
that includes requests in flight at the other replicas (``remote_in_flight``, published by
policy_server.serving.replicas once per sweep interval), and the end itself re-checks idleness in its transaction.

Side turns are served but neither recorded nor used for pairing (heartbeats carry unrelated messages).
A session ends on ``X-Session-Done`` (its last turn gets no next state) or when it has been idle for
``session_idle_timeout_s`` (same outcome); the reward pipeline then handles the last turn per mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from engine.continuation import PriorTurn
from engine.records import RejectReason, TurnRecord
from policy_server.serving.side_rules import SideRules
from policy_server.store import Resolution, SampleStore

logger = logging.getLogger(__name__)

FEEDBACK_ROLES = ("user", "tool")


@dataclass(frozen=True)
class Pairing:
    """Outcome of comparing a new request with the awaiting turn."""

    kind: str  # "paired" | "mismatch"
    next_state: list[dict[str, object]] | None = None
    note: str | None = None
    dropped: list[str] = field(default_factory=list)


def _args(value: object) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value.strip()
    return value


def _text(content: object) -> str:
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content.strip() if isinstance(content, str) else ""


# Inline reasoning blocks a client may hide from a resent reply (a stray closing tag stays: clients keep it).
_INLINE_REASONING = re.compile(r"<(think|thinking|thought|reasoning)\b[^<>]*>.*?</\1\s*>", re.DOTALL | re.IGNORECASE)
_SPACES = re.compile(r"\s+")


def visible_text(text: str) -> str:
    """An assistant text as its reader sees it: inline reasoning blocks removed, whitespace runs collapsed (pure)."""
    if "<" in text:
        text = _INLINE_REASONING.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def _items(value: object) -> list[object]:
    """A JSON list (tool calls, content parts); ``[]`` when absent or null."""
    return value if isinstance(value, list) else []


def _call_key(call: object) -> tuple[object, str]:
    """A tool call's name and its arguments as canonical JSON (a call off the shape keys as no name, no args)."""
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    return fn.get("name"), json.dumps(_args(fn.get("arguments")), sort_keys=True)


def message_key(msg: dict[str, object]) -> tuple[object, ...]:
    """What must stay equal for two messages to count as the same history entry."""
    calls = tuple(_call_key(tc) for tc in _items(msg.get("tool_calls")))
    text = _text(msg.get("content"))
    return (
        msg.get("role"),
        visible_text(text) if msg.get("role") == "assistant" else text,
        calls,
        msg.get("tool_call_id") if msg.get("role") == "tool" else None,
    )


def drop_side_exchanges(
    tail: list[dict[str, object]], side_rules: SideRules | None
) -> tuple[list[dict[str, object]], list[str]]:
    """``tail`` without the exchanges a side rule claims (a user message the rules match, and the assistant/tool
    messages after it up to the next user message), and the names of the rules that matched (pure).

    A stock agent keeps its housekeeping runs (a memory flush, a heartbeat) in the conversation it resends; they are
    no feedback on the recorded reply and must not turn the next turn into a mismatch.
    """
    if side_rules is None:
        return tail, []
    kept: list[dict[str, object]] = []
    names: list[str] = []
    i = 0
    while i < len(tail):
        name = side_rules.match([tail[i]]) if tail[i].get("role") == "user" else None
        if name is None:
            kept.append(tail[i])
            i += 1
            continue
        names.append(name)
        i += 1
        while i < len(tail) and tail[i].get("role") != "user":
            i += 1
    return kept, names


def pair_next_state(
    prev_messages: list[dict[str, object]],
    prev_response: dict[str, object],
    new_messages: list[dict[str, object]],
    side_rules: SideRules | None = None,
) -> Pairing:
    """Apply the pairing rule of the module docstring (pure); with ``side_rules``, side exchanges after the recorded
    reply are left out first (:func:`drop_side_exchanges`), and ephemeral messages are ignored everywhere."""
    expected = message_key({"role": "assistant", **prev_response})
    # A reply with nothing to show (all reasoning, e.g. cut by max_tokens in its think block) is one a client
    # may leave out of the history it resends (OpenClaw does): then the feedback follows the history directly.
    invisible = not expected[1] and not expected[2]
    after = _after_history(prev_messages, new_messages, side_rules, min_after=1 if invisible else 2)
    if isinstance(after, Pairing):
        return after
    omitted = invisible and after[0].get("role") != "assistant"
    if not omitted and message_key(after[0]) != expected:
        n = sum(1 for m in prev_messages if side_rules is None or not side_rules.is_ephemeral(m))
        return Pairing("mismatch", note=f"message {n} is not the recorded assistant reply")
    tail, side = drop_side_exchanges(after if omitted else after[1:], side_rules)
    kept = [dict(m) for m in tail if m.get("role") in FEEDBACK_ROLES]
    dropped = [str(m.get("role")) for m in tail if m.get("role") not in FEEDBACK_ROLES]
    if not kept:
        return Pairing("mismatch", note="no user or tool message after the recorded reply")
    if any(m.get("role") == "assistant" for m in tail):
        return Pairing("mismatch", note="another assistant message follows the recorded reply")
    state = [{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")} for m in kept]
    for m in state:
        m["content"] = _text(m.get("content"))
    notes = ["the client left out the recorded reply (nothing visible in it)"] if omitted else []
    notes += [f"dropped non-feedback roles {dropped}"] if dropped else []
    notes += [f"left out side exchanges {side}"] if side else []
    return Pairing("paired", next_state=state, note="; ".join(notes) or None, dropped=dropped)


@dataclass(frozen=True)
class CompactionMatch:
    """How a request pairs an awaiting turn across a compaction: the pairing, how many of the turn's recorded
    messages (from its end: the message the reply answered, then earlier ones) the request kept right before the
    reply, and whether it opens with the turn's opening message."""

    pairing: Pairing
    kept: int
    same_opening: bool


def pair_across_compaction(
    prev_messages: list[dict[str, object]],
    prev_response: dict[str, object],
    new_messages: list[dict[str, object]],
    side_rules: SideRules | None = None,
) -> CompactionMatch | None:
    """Rule 3 of the module docstring (pure): the match, or None when ``new_messages`` does not end with the
    recorded reply and feedback. Try :func:`pair_next_state` first: a request that extends the recorded history
    pairs by that rule (this one would also accept it)."""
    expected = message_key({"role": "assistant", **prev_response})
    if not expected[1] and not expected[2]:
        return None  # nothing visible: clients leave such a reply out, so it cannot mark where the history resumes
    if side_rules is not None:
        prev_messages = [m for m in prev_messages if not side_rules.is_ephemeral(m)]
        new_messages = [m for m in new_messages if not side_rules.is_ephemeral(m)]
    # The recorded reply is the request's last assistant message once kept side exchanges are left out.
    at = next((i for i in range(len(new_messages) - 1, -1, -1) if message_key(new_messages[i]) == expected), None)
    if at is None or not prev_messages:
        return None
    tail, side = drop_side_exchanges(new_messages[at + 1 :], side_rules)
    feedback = [m for m in tail if m.get("role") in FEEDBACK_ROLES]
    dropped = [str(m.get("role")) for m in tail if m.get("role") not in FEEDBACK_ROLES]
    if not feedback or "assistant" in dropped:
        return None  # no feedback, or another reply after this one
    kept = 0
    while kept < min(at, len(prev_messages)) and message_key(new_messages[at - 1 - kept]) == message_key(
        prev_messages[-1 - kept]
    ):
        kept += 1
    same_opening = at > 0 and message_key(new_messages[0]) == message_key(prev_messages[0])
    state = [{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")} for m in feedback]
    for m in state:
        m["content"] = _text(m.get("content"))
    notes = [
        f"paired across a compaction: the history before the reply was rewritten ({kept} recorded message(s) kept)"
    ]
    notes += [f"dropped non-feedback roles {dropped}"] if dropped else []
    notes += [f"left out side exchanges {side}"] if side else []
    return CompactionMatch(
        Pairing("paired", next_state=state, note="; ".join(notes), dropped=dropped), kept, same_opening
    )


def _after_history(
    prev_messages: list[dict[str, object]],
    new_messages: list[dict[str, object]],
    side_rules: SideRules | None,
    min_after: int = 2,
) -> list[dict[str, object]] | Pairing:
    """The (non-ephemeral) messages of ``new_messages`` after the recorded history, at least ``min_after``, or
    the mismatch that says why there are none (pure)."""
    k = len(prev_messages)
    if len(new_messages) >= k + min_after and new_messages[:k] == prev_messages:
        # The history came back exactly as recorded (the usual case, one C-level comparison): only what
        # follows it needs a look. Ephemeral filtering is per message, so it changes neither side's copy of it.
        rest = new_messages[k:]
        if side_rules is not None:
            rest = [m for m in rest if not side_rules.is_ephemeral(m)]
        if len(rest) >= min_after:
            return rest
    if side_rules is not None:
        prev_messages = [m for m in prev_messages if not side_rules.is_ephemeral(m)]
        new_messages = [m for m in new_messages if not side_rules.is_ephemeral(m)]
    n = len(prev_messages)
    if len(new_messages) < n + min_after:
        expected = n + min_after - 1
        return Pairing("mismatch", note=f"new history has {len(new_messages)} messages, expected more than {expected}")
    for i, (old, new) in enumerate(zip(prev_messages, new_messages[:n], strict=True)):
        if message_key(old) != message_key(new):
            return Pairing("mismatch", note=f"message {i} ({old.get('role')}) was rewritten")
    return new_messages[n:]


@dataclass
class Arrival:
    """A main request between its arrival and its turn record: the pairing it will write (None: nothing),
    and the recorded turn it extends (``prior``: set when paired; its prompt continues that turn's ids)."""

    session_id: str
    resolution: Resolution | None
    settled: bool = False  # the resolution is written (or being written) and the in-flight count released
    prior: PriorTurn | None = None


@dataclass
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # requests holding or awaiting ``lock``


class SessionTracker:
    """Applies pairing and session ends against the store; runs the idle sweeper.

    ``on_new_work`` is called (no args) whenever a sample becomes pending_judge, to wake the dispatcher.
    """

    def __init__(
        self,
        store: SampleStore,
        *,
        idle_timeout_s: float,
        sweep_interval_s: float = 1.0,
        on_new_work: Callable[[], object] | None = None,
    ):
        self.store = store
        self.side_rules: SideRules | None = None  # side exchanges inside a resent transcript are no feedback
        self.idle_timeout_s = idle_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self.on_new_work = on_new_work or (lambda: None)
        self._locks: dict[str, _SessionLock] = {}
        self._in_flight: dict[str, int] = {}  # main requests per session between arrival and settle
        self._settles: set[asyncio.Task[None]] = set()
        self.mismatches = 0
        self.compactions = 0  # awaiting turns paired across a compaction by a request of another session
        # Replicas on a shared store: the sessions with a main request in flight at another replica
        # (policy_server.serving.replicas); the sweep leaves those alone too.
        self.remote_in_flight: Callable[[], Awaitable[set[str]]] | None = None

    def in_flight_sessions(self) -> list[str]:
        """The sessions with a main request of this process between arrival and settle (published to replicas)."""
        return list(self._in_flight)

    @contextlib.asynccontextmanager
    async def _lock(self, session_id: str) -> AsyncIterator[None]:
        """Serialise one session's store work; counts who holds or awaits it, so an ended session's lock is
        dropped only when nobody does."""
        entry = self._locks.setdefault(session_id, _SessionLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1

    async def on_request(
        self, session_id: str, messages: list[dict[str, object]], *, main: bool, done: bool
    ) -> Arrival | None:
        """Called when a request arrives (before generation).

        A main request pairs the awaiting turn (a read; no commit) and returns its :class:`Arrival`, to be
        passed to :meth:`on_main_turn` and, whatever happens, to :meth:`settle_later`. A side request
        touches the session, or ends it with done (one transaction), and returns None.
        """
        if main:
            self._in_flight[session_id] = self._in_flight.get(session_id, 0) + 1
            try:
                async with self._lock(session_id):
                    resolution, prior = await asyncio.to_thread(self._pair, session_id, messages)
            except BaseException:
                self._release(session_id)
                raise
            return Arrival(session_id, resolution, prior=prior)
        async with self._lock(session_id):
            new_work = await asyncio.to_thread(self._side, session_id, done)
        if done:
            self._forget_lock(session_id)
        if new_work:
            self.on_new_work()
        return None

    def _side(self, session_id: str, done: bool) -> bool:
        if done:  # a side request that ends the session: the awaiting main turn becomes the last turn
            return bool(self.store.end_session(session_id))
        self.store.touch_session(session_id)
        return False

    def _pair(self, session_id: str, messages: list[dict[str, object]]) -> tuple[Resolution | None, PriorTurn | None]:
        """Blocking part of :meth:`on_request` for a main request (worker thread): the pairing to write, and
        the awaiting turn as the prompt to continue when the request extends it."""
        awaiting = self.store.awaiting_turn(session_id)
        if awaiting is None:
            return None, None
        p = pair_next_state(awaiting.messages, awaiting.response, messages, self.side_rules)
        if p.kind == "mismatch":
            self.mismatches += 1
            logger.warning(
                "session %s turn %s: history mismatch (%s); rejecting that turn",
                session_id,
                awaiting.turn_index,
                p.note,
            )
        resolution = Resolution(
            awaiting.turn_index,
            p.kind,
            p.next_state,
            p.note,
            RejectReason.HISTORY_MISMATCH if p.kind == "mismatch" else None,
        )
        return resolution, PriorTurn.from_turn(awaiting.to_json()) if p.kind == "paired" else None

    async def on_main_turn(
        self,
        session_id: str,
        record: TurnRecord,
        *,
        done: bool,
        arrival: Arrival | None = None,
        redacted: list[str] | None = None,
    ) -> int:
        """Record a generated main turn with its arrival's pairing: ONE commit, before the client gets the answer.
        ``redacted``: the secret kinds redacted out of ``record`` (its sample is then rejected ``secret``)."""
        owned = arrival is not None and not arrival.settled
        if arrival is not None and owned:
            arrival.settled = True
        try:
            async with self._lock(session_id):
                idx = await asyncio.to_thread(
                    self.store.record_turn,
                    session_id,
                    record,
                    session_done=done,
                    resolve=arrival.resolution if arrival is not None and owned else None,
                    redacted=redacted,
                )
        except BaseException:
            if arrival is not None and owned:
                arrival.settled = False  # nothing was written: settle_later still owes the pairing
            raise
        if arrival is not None and owned:
            self._release(arrival.session_id)
        if done:
            self._forget_lock(session_id)
        self.on_new_work()
        return idx

    def _forget_lock(self, session_id: str) -> None:
        """Drop the lock of an ended session (a new request would create a fresh one), unless a request of it
        holds or awaits the lock right now: dropping it then would let two requests run unserialised."""
        entry = self._locks.get(session_id)
        if entry is not None and entry.users == 0:
            del self._locks[session_id]

    def settle_later(self, arrival: Arrival | None) -> None:
        """The request ends without (more) recording: write its pairing alone if no turn record took it.

        Idempotent and non-blocking (safe in ``finally`` and cancellation paths): the write runs as its own task.
        """
        if arrival is None or arrival.settled:
            return
        arrival.settled = True
        task = asyncio.get_running_loop().create_task(self._settle(arrival), name=f"settle-{arrival.session_id}")
        self._settles.add(task)
        task.add_done_callback(self._settles.discard)

    async def _settle(self, arrival: Arrival) -> None:
        try:
            r = arrival.resolution
            if r is None:
                return
            async with self._lock(arrival.session_id):
                sample_id = await asyncio.to_thread(self.store.resolve_turn, arrival.session_id, r, touch=True)
            if sample_id is not None:
                self.on_new_work()
        except Exception:  # a store failure here must not be silent; the turn stays awaiting (sweep ends it)
            logger.exception(
                "session %s: writing the pairing of turn %s failed",
                arrival.session_id,
                arrival.resolution.turn_index if arrival.resolution else None,
            )
        finally:
            self._release(arrival.session_id)

    def pair_compacted(self, session_id: str, turn_index: int, pairing: Pairing, successor: str) -> None:
        """Claim the awaiting turn ``turn_index`` of ``session_id``, which a request of session ``successor`` pairs
        across a compaction (:func:`pair_across_compaction`), and write that pairing (its own commit, as
        :meth:`settle_later` does). The claim is synchronous, so under the caller's lock no other request can
        continue that turn meanwhile; the write is idempotent like every pairing write."""
        self._in_flight[session_id] = self._in_flight.get(session_id, 0) + 1
        self.compactions += 1
        note = f"{pairing.note}; the conversation continues in session {successor}"
        logger.info("session %s turn %s: paired across a compaction by session %s", session_id, turn_index, successor)
        self.settle_later(Arrival(session_id, Resolution(turn_index, "paired", pairing.next_state, note)))

    def in_flight(self, session_id: str) -> bool:
        """Whether a main request of this session is between its arrival and its settle."""
        return self._in_flight.get(session_id, 0) > 0

    def _release(self, session_id: str) -> None:
        left = self._in_flight.get(session_id, 0) - 1
        if left > 0:
            self._in_flight[session_id] = left
        else:
            self._in_flight.pop(session_id, None)

    async def drain_settles(self) -> None:
        """Wait for pairing writes still running (shutdown, tests)."""
        while self._settles:
            await asyncio.gather(*list(self._settles), return_exceptions=True)

    async def sweep_idle(self, now: float | None = None) -> int:
        """End every session idle for longer than the timeout; returns how many ended."""
        now = time.time() if now is None else now
        ended = 0
        idle = await asyncio.to_thread(self.store.idle_sessions, now - self.idle_timeout_s)
        remote = await self.remote_in_flight() if idle and self.remote_in_flight is not None else set()
        for sid in idle:
            if self._in_flight.get(sid) or sid in remote:  # a main request is being answered: not idle
                continue
            async with self._lock(sid):
                # Re-checked in the transaction: a turn recorded meanwhile at another replica keeps it open.
                await asyncio.to_thread(self.store.end_session, sid, now=now, idle_before=now - self.idle_timeout_s)
            self._locks.pop(sid, None)
            ended += 1
        if ended:
            logger.info("ended %d idle session(s)", ended)
            self.on_new_work()
        return ended

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep_idle()
            except Exception:  # the sweeper must outlive a transient store error; it retries next tick
                logger.exception("idle sweep failed")
