"""A chat answer the client will not get (in full): abort its engine work and keep it out of training.

:func:`abandon` marks the generation abandoned (an abort that comes back is never resumed, see
policy_server.serving.generation), sends ``abort_request(rid prefix)`` to every engine worker (best effort,
short timeout, logged) and keeps the turn out of training: a reply the client did not get in full is never
recorded; if the disconnect hit while the record was being written (one transaction in a worker thread:
it commits whole or not at all) the record is awaited and then resolved ``mismatch`` with its sample
``rejected`` (``reject_reason`` ``client_disconnected``), since the client's next request cannot contain
it. "Delivered" means the stream got to ``data: [DONE]`` (the non-streaming JSON body was handed over).
A generation that ends in an EngineTimeout is aborted the same way (the engine may still be running it).

The caller is usually being cancelled when this runs, so :func:`abandon_detached` runs the cleanup as its
own task (held here until it ends) and marks the generation abandoned before any await.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from engine.disconnect import abort_engine_requests
from engine.errors import EngineError, EngineTimeout
from engine.records import RejectReason, SampleState
from policy_server.serving.generation import GenResult
from policy_server.serving.turn_state import ServingState
from policy_server.store import Resolution, SampleStore

logger = logging.getLogger(__name__)
DISCONNECT_REASON = RejectReason.CLIENT_DISCONNECTED
_cleanups: set[asyncio.Task[None]] = set()  # strong refs: a detached cleanup must not be garbage-collected


class TurnInFlight(Protocol):
    """One chat request as the disconnect cleanup sees it."""

    sid: str | None
    res: GenResult
    record_task: asyncio.Task[int] | None  # the turn record on its way into the store


def reject_turn(store: SampleStore, sid: str, turn_index: int) -> str:
    """Keep a recorded but undelivered turn out of training (worker thread): which outcome applied."""
    note = "client disconnected before the reply was delivered"
    if store.resolve_turn(sid, Resolution(turn_index, "mismatch", None, note, DISCONNECT_REASON)) is not None:
        return SampleState.REJECTED
    # Already resolved: the request ended its session (or the idle sweep did), so its sample was created
    # pending_judge in the same transaction; reject it unless the judge has decided it in the meantime.
    for row in store.list_samples(session_id=sid, status=SampleState.PENDING_JUDGE, limit=10_000):
        if row.turn_index == turn_index and store.complete_judge(
            row.sample_id, status=SampleState.REJECTED, reject_reason=DISCONNECT_REASON, included=False, data=None
        ):  # no Sample JSON, like every pairing rejection
            return SampleState.REJECTED
    return "already decided"


async def abandon(st: ServingState, turn: TurnInFlight, why: str) -> None:
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
    outcome = await asyncio.to_thread(reject_turn, st.store, turn.sid, idx)
    logger.info(
        "session %s turn %d was recorded as the client disconnected: %s (%s)", turn.sid, idx, outcome, DISCONNECT_REASON
    )


def abandon_detached(
    st: ServingState, turn: TurnInFlight, why: str, *, close: AsyncGenerator[str, None] | None = None
) -> asyncio.Task[None]:
    """Run :func:`abandon` as its own task: it must finish even when the caller is being cancelled."""
    turn.res.abandoned = True  # at once, before any await: nothing may resubmit from here on

    async def run() -> None:
        if close is not None:
            await close.aclose()  # stop reading the engine stream first
        await abandon(st, turn, why)

    task = asyncio.create_task(run(), name=f"abandon-{turn.res.rid_prefix}")
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    return task


def engine_failed(st: ServingState, turn: TurnInFlight, exc: EngineError) -> None:
    """Count an engine failure; a timed-out generation is abandoned (the engine may still be generating it)."""
    st.metrics.engine_errors.labels(kind=type(exc).__name__).inc()
    if isinstance(exc, EngineTimeout):  # we stopped waiting; the engine may still be generating it
        abandon_detached(st, turn, "engine call timed out")
