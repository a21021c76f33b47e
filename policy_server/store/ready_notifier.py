"""Wake-ups for lease waiters when samples become ``ready``: the notifier interface and its in-process form.

Role: ``GET /v1/samples/lease`` with ``wait_s`` sleeps on a notifier instead of polling the store. Every
store write that makes a sample ``ready`` (a judge outcome, session-scope PRM scoring, an expired lease
returning its samples) calls :meth:`ReadyNotifier.notify` after its transaction committed
(policy_server.store.base ``on_ready``); a waiter re-checks the store on each wake-up.

Contract:

- ``generation()`` is a counter that ``notify()`` increments; a waiter reads it BEFORE it checks the store
  and passes it to ``wait(seen, timeout_s)``, which returns at once when a notification came after that
  read. So a sample that becomes ready between the check and the wait is never missed.
- ``notify()`` may be called from any thread (store writes run in worker threads).
- ``wait`` wakes EVERY waiter; they then compete for the samples through the store's lease transaction,
  which hands each sample to one lease only.

:class:`LocalReadyNotifier` serves one process. With the PostgreSQL store shared by replicas the same notifier is
fed across processes: a commit that made samples ready sends ``NOTIFY hindsight_ready`` and every replica's store
listener calls its ``on_ready`` (policy_server.store.postgres), so a waiter at any replica wakes on a judge outcome
written at another one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from engine.records import Sample
from policy_server.store import SampleStore


class ReadyNotifier(Protocol):
    def generation(self) -> int: ...

    def notify(self) -> None: ...

    async def wait(self, seen: int, timeout_s: float) -> bool: ...


class LocalReadyNotifier:
    """In-process notifier bound to the event loop it was created on (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._generation = 0
        self._changed = asyncio.Event()

    def generation(self) -> int:
        return self._generation

    def notify(self) -> None:
        """Thread-safe: schedules the wake-up on the notifier's loop (a closed loop has no waiter left)."""
        try:
            self._loop.call_soon_threadsafe(self._bump)
        except RuntimeError:
            pass

    def _bump(self) -> None:
        self._generation += 1
        # Waking everybody and replacing the event: each waiter compares generations, not the event.
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, seen: int, timeout_s: float) -> bool:
        """True when a notification came after ``seen`` (at once if it already did), False at the timeout."""
        if self._generation != seen:
            return True
        if timeout_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return self._generation != seen
        return True


async def lease_when_ready(
    store: SampleStore, notifier: ReadyNotifier, *, max_n: int, min_n: int, wait_s: float, lease_s: float
) -> tuple[str, list[Sample]] | None:
    """The lease route's wait: a lease of up to ``max_n`` samples as soon as ``min_n`` are ready, else at
    ``wait_s`` whatever is ready (None when nothing is). Sleeps on ``notifier`` between looks, and also until
    the earliest active lease's deadline, whose expiry is only applied when the store is next written."""
    end = time.monotonic() + wait_s
    while True:
        seen = notifier.generation()  # before the look, so a notification racing it is not lost
        left_s = end - time.monotonic()
        got = await asyncio.to_thread(store.lease, max_n, lease_s, min_n=min_n if left_s > 0 else 1)
        if got is not None or left_s <= 0:
            return got
        expiry = await asyncio.to_thread(store.next_lease_expiry)
        if expiry is not None:
            left_s = min(left_s, max(0.0, expiry - time.time()) + 0.01)
        await notifier.wait(seen, left_s)
