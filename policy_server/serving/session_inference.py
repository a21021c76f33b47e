"""Sessions without headers: continue the open session whose recorded transcript a request extends.

Role: the last rule of the session precedence (policy_server.serving.identity), on by default
(``infer_sessions``; ``--no-infer-sessions`` turns it off, and then a request without any session id or
hint is served and not recorded). Many clients
(hosted agent UIs, IDE agents) cannot add ``X-Session-Id``; they do resend the whole transcript, which
is enough to find the session a main request belongs to.

Rule, for a main request without a session id and with messages ``N``:

1. Candidates are the open sessions whose awaiting turn T (messages ``M``, reply ``R``) is extended by
   ``N`` in the sense of the pairing rule (policy_server.serving.pairing.pair_next_state: ``N`` starts with ``M``
   and ``R``, then brings user/tool feedback). Only a real extension counts.
2. The candidate with the longest recorded transcript (``len(M)``) wins: a shorter one is a different
   conversation that happens to share an opening. Ties (same length, hence the same ``M`` and ``R``:
   e.g. the same task run in parallel under greedy decoding) go to the oldest awaiting turn; the pairs
   are identical, so the reward signal is the same whichever wins, and the other session is matched by
   its own continuation.
3. No candidate, but an awaiting turn the request pairs **across a compaction** (rule 3 of
   policy_server.serving.pairing, :func:`find_compacted`): that turn is paired and claimed, and the request starts
   a new session ``inferred-<32 hex>`` (outcome ``compacted``). The summary breaks the token continuity and the
   transcript a session's turns extend, so the conversation after a compaction is a session of its own; its first
   turn's ``session_decision`` is ``compacted`` and the paired turn's note names it.
4. Otherwise: a new session ``inferred-<32 hex>``. This includes a **client retry** of a request whose
   reply was lost (``N`` equals ``M``, no reply in it): it is indistinguishable from a fresh conversation
   with the same opening (common in agent evals), so it starts a session instead of rejecting another
   one's turn. The earlier turn keeps waiting and ends with its session (idle timeout), as a last turn.

Matching and claiming the session happen under one lock, so two concurrent continuations never claim the
same turn: the claim registers the request as the session's in-flight main request (its pairing is written
with its turn record, one commit), and a session with a main request in flight is no candidate. The session id is returned to the client in the
``X-Hindsight-Session-Id`` header (and the ``hindsight`` response field): a client that can keep it may
send it back. Each outcome is counted (``hindsight_policy_inferred_sessions_total{outcome}``:
``continued``, ``started``, ``tied``, ``compacted``), and ``/v1/samples/stats`` reports ``inferred_sessions``.
Cost: one read of the open sessions' awaiting turns per header-less main request.
"""

from __future__ import annotations

import asyncio
import uuid

from engine.records import Turn
from policy_server.metrics import Metrics
from policy_server.serving.pairing import CompactionMatch, message_key, pair_across_compaction, pair_next_state
from policy_server.serving.sessions import Arrival, SessionTracker
from policy_server.serving.side_rules import SideRules
from policy_server.store import SampleStore

INFERRED_PREFIX = "inferred-"


def choose_session(
    awaiting: list[Turn], messages: list[dict[str, object]], side_rules: SideRules | None = None
) -> tuple[str | None, bool]:
    """(session id to continue or None, whether the best match was a tie); ``awaiting`` oldest first (pure)."""
    best: list[str] = []
    best_len = -1
    first = message_key(messages[0]) if messages else None
    for turn in awaiting:
        prev = turn.messages
        # (ephemeral messages change the counts; a reply with nothing visible may be left out)
        short = side_rules is None and len(messages) < len(prev) + 1
        if len(prev) < best_len or short or message_key(prev[0]) != first:
            continue  # cheap rejections before the full pairing comparison
        if pair_next_state(prev, turn.response, messages, side_rules).kind != "paired":
            continue
        if len(prev) > best_len:
            best, best_len = [turn.session_id], len(prev)
        else:
            best.append(turn.session_id)
    return (best[0] if best else None), len(best) > 1


def find_compacted(
    awaiting: list[Turn],
    messages: list[dict[str, object]],
    side_rules: SideRules | None = None,
    key: str | None = None,
) -> tuple[Turn, CompactionMatch, bool] | None:
    """The awaiting turn ``messages`` pairs across a compaction, its match, and whether the best match was a tie
    (pure); ``awaiting`` oldest first. The turn whose recorded messages the request kept most of wins, then one
    whose opening message it kept, then, with the request's session ``key``, the session whose id shares the
    longest start with it (OpenClaw's ``id:1`` after ``id:0``); ties go to the oldest, as in
    :func:`choose_session`."""
    replies = {message_key(m) for m in messages if m.get("role") == "assistant"}
    best: tuple[Turn, CompactionMatch] | None = None
    best_rank = (-1, False, -1)
    tied = False
    for turn in awaiting:
        if message_key({"role": "assistant", **turn.response}) not in replies:
            continue  # cheap rejection: the request does not hold this reply at all
        match = pair_across_compaction(turn.messages, turn.response, messages, side_rules)
        if match is None:
            continue
        rank = (match.kept, match.same_opening, _shared_start(turn.session_id, key) if key is not None else 0)
        if rank > best_rank:
            best, best_rank, tied = (turn, match), rank, False
        elif rank == best_rank:
            tied = True
    return (best[0], best[1], tied) if best is not None else None


def _shared_start(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (pure)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SessionInferrer:
    """Finds (and claims) the session of a header-less main request; one per server."""

    def __init__(self, store: SampleStore, sessions: SessionTracker, metrics: Metrics):
        self.store = store
        self.sessions = sessions
        self.metrics = metrics
        self._lock = asyncio.Lock()

    async def claim(self, messages: list[dict[str, object]], *, done: bool) -> tuple[str, Arrival | None]:
        """The session this request continues with its arrival (as SessionTracker.on_request), or a new id.

        The caller owns the arrival exactly as one from ``on_request``: it goes to ``on_main_turn`` and, whatever
        happens, to ``settle_later``. A new session has no awaiting turn, hence no arrival.
        """
        sid, arrival, _ = await self.claim_with_outcome(messages, done=done)
        return sid, arrival

    async def claim_with_outcome(
        self, messages: list[dict[str, object]], *, done: bool
    ) -> tuple[str, Arrival | None, str]:
        """:meth:`claim` and its outcome: ``continued``, ``tied`` (continued, the best match was a tie), ``compacted``
        (a new session, the turn before the compaction paired) or ``started``."""
        async with self._lock:
            awaiting = await asyncio.to_thread(self.store.awaiting_open_turns)
            # A session whose awaiting turn is already being continued is claimed (pairing written with that turn).
            awaiting = [t for t in awaiting if not self.sessions.in_flight(t.session_id)]
            sid, tied = choose_session(awaiting, messages, self.sessions.side_rules)
            if sid is None and (found := find_compacted(awaiting, messages, self.sessions.side_rules)) is not None:
                turn, match, _ = found
                new = f"{INFERRED_PREFIX}{uuid.uuid4().hex}"
                self.sessions.pair_compacted(turn.session_id, turn.turn_index, match.pairing, new)
                self.metrics.inferred_sessions.labels(outcome="compacted").inc()
                return new, None, "compacted"
            if sid is None:
                self.metrics.inferred_sessions.labels(outcome="started").inc()
                return f"{INFERRED_PREFIX}{uuid.uuid4().hex}", None, "started"
            if tied:
                self.metrics.inferred_sessions.labels(outcome="tied").inc()
            self.metrics.inferred_sessions.labels(outcome="continued").inc()
            arrival = await self.sessions.on_request(sid, messages, main=True, done=done)
            return sid, arrival, "tied" if tied else "continued"
