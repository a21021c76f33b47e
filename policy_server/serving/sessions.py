"""Session tracking: each main request's pairing applied against the store, and session ends.

Role: for each main request, read the session's awaiting turn and decide its pairing by the pairing rule
(policy_server.serving.pairing), then commit it with the turn the request produces, or alone when none is
recorded; end sessions on ``X-Session-Done`` or after an idle timeout. State lives in the store, so pairing
and idle expiry survive restarts.

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
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from engine.continuation import PriorTurn
from engine.records import RejectReason, TurnRecord
from policy_server.serving.pairing import Pairing, pair_next_state
from policy_server.serving.side_rules import SideRules
from policy_server.store import Resolution, SampleStore

logger = logging.getLogger(__name__)


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
        return resolution, PriorTurn.from_turn(awaiting) if p.kind == "paired" else None

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
        across a compaction (policy_server.serving.pairing.pair_across_compaction), and write that pairing (its
        own commit, as :meth:`settle_later` does). The claim is synchronous, so under the caller's lock no other
        request can continue that turn meanwhile; the write is idempotent like every pairing write."""
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
