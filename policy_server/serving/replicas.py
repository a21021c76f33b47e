"""Shared admin state between policy server replicas on one PostgreSQL store: reward mode and weight sync.

Role: what an admin call changes at one replica must hold at every replica. Both live in the store's
``runtime`` table, and every change is announced with ``NOTIFY hindsight_admin`` (store.notify_admin), which
each replica's store listener turns into a :meth:`ReplicaSync.refresh`; a periodic refresh
(``interval_s``) catches anything a lost notification missed.

- Reward mode (``runtime.mode``, written by ``POST /admin/mode``): every replica's ModeState follows it.
- Weight sync (``runtime.weights`` = ``{"paused": bool, "epoch": int, "version": str | None}``): the replica
  the trainer called (:meth:`announce_pause`) writes ``paused`` BEFORE it pauses the engines and waits until
  every live replica acknowledged the pause (``runtime["weights_seen:<replica>"]`` = the epoch), at most
  ``ack_timeout_s``: so no replica submits new work into a paused engine. Every other replica closes its
  WeightGate: new chat requests wait there (delayed, not failed; in-flight ones aborted by the pause are
  resubmitted once the gate opens, as at the updating replica). :meth:`announce_done` publishes the new
  ``weight_version`` and opens every gate. A pause whose announcer died is lifted after ``max_pause_s``.
- Liveness: each replica writes ``runtime["replica:<id>"]`` = its last refresh time and the sessions it has a
  main request in flight for (the idle sweep of every replica leaves those alone); a replica silent for
  ``3 * interval_s`` is not waited for and its list no longer counts.

With the SQLite store there is one process and nothing to share: the app does not start this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from policy_server.errors import StoreBusy
from policy_server.serving.weight_sync import WeightGate

if TYPE_CHECKING:  # types only: the store and reward packages do not import this module back
    from policy_server.rewards.modes import ModeState
    from policy_server.store import SampleStore

logger = logging.getLogger(__name__)


class ReplicaSync:
    """Follows the shared reward mode and weight-sync pause (see the module docstring)."""

    def __init__(
        self,
        store: SampleStore,
        *,
        replica_id: str,
        mode_state: ModeState,
        gate: WeightGate,
        interval_s: float = 1.0,
        ack_timeout_s: float = 5.0,
        max_pause_s: float = 600.0,
        in_flight: Callable[[], list[str]] | None = None,
    ):
        self.store = store
        self.replica_id = replica_id
        self.mode_state = mode_state
        self.gate = gate
        self.interval_s = interval_s
        self.ack_timeout_s = ack_timeout_s
        self.max_pause_s = max_pause_s
        self.in_flight = in_flight  # the sessions with a main request in flight here (SessionTracker)
        self.local_update = False  # this replica's WeightSync holds the gate itself
        self._remote_paused = False
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def wake(self) -> None:
        """Thread-safe (called by the store listener): refresh now."""
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except StoreBusy as exc:  # transient: the next tick retries
                logger.warning("replica state refresh deferred: %s", exc)
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def refresh(self) -> None:
        mode, weights = await asyncio.to_thread(self._read)
        if mode is not None and mode != self.mode_state.to_dict():
            self.mode_state.set(mode["mode"], mode["w_rl"], mode["w_opd"])
            logger.info("reward mode changed at another replica: %s", mode)
        if weights is not None and not self.local_update:
            fresh = time.time() - weights.get("at", 0.0) < self.max_pause_s
            if weights.get("paused") and fresh:
                if not self._remote_paused:
                    self._remote_paused = True
                    self.gate.close()
                    logger.info("weight update at another replica: new chat requests wait")
                await asyncio.to_thread(
                    self.store.set_runtime, f"weights_seen:{self.replica_id}", {"epoch": weights["epoch"]}
                )
            else:
                if weights.get("version") is not None:
                    self.gate.version = weights["version"]
                if self._remote_paused:
                    self._remote_paused = False
                    self.gate.epoch += 1
                    self.gate.open()
                    logger.info("weight update done at another replica: weight_version %s", self.gate.version)
        await asyncio.to_thread(
            self.store.set_runtime,
            f"replica:{self.replica_id}",
            {"at": time.time(), "in_flight": self.in_flight() if self.in_flight else []},
        )

    async def remote_in_flight(self) -> set[str]:
        """Sessions with a main request in flight at another live replica (for the idle sweep)."""
        return await asyncio.to_thread(self._remote_in_flight)

    def _remote_in_flight(self) -> set[str]:
        live_after = time.time() - 3 * self.interval_s
        out: set[str] = set()
        for r in self.store.runtime_keys("replica:"):
            beat = self.store.get_runtime(f"replica:{r}") or {}
            if r != self.replica_id and beat.get("at", 0) > live_after:
                out.update(beat.get("in_flight", []))
        return out

    def _read(self) -> tuple[Any, Any]:
        return self.store.get_runtime("mode"), self.store.get_runtime("weights")

    async def leave(self) -> None:
        """At shutdown: this replica no longer counts as live (an update does not wait for its acknowledgement)."""
        for key in (f"replica:{self.replica_id}", f"weights_seen:{self.replica_id}"):
            await asyncio.to_thread(self.store.delete_runtime, key)

    # ------------------------------------------------------------------ the updating replica
    async def announce_pause(self) -> int:
        """Before the engines pause: every live replica holds new requests (acknowledged, bounded wait)."""
        self.local_update = True
        current = await asyncio.to_thread(self.store.get_runtime, "weights") or {}
        epoch = int(current.get("epoch", 0)) + 1
        await asyncio.to_thread(
            self.store.set_runtime,
            "weights",
            {"paused": True, "epoch": epoch, "version": self.gate.version, "at": time.time(), "by": self.replica_id},
        )
        await asyncio.to_thread(self.store.notify_admin)
        end = time.monotonic() + self.ack_timeout_s
        while True:
            missing = await asyncio.to_thread(self._unacknowledged, epoch)
            if not missing:
                return epoch
            if time.monotonic() >= end:
                logger.warning(
                    "replica(s) %s did not acknowledge the weight-update pause within %.1fs; going on",
                    missing,
                    self.ack_timeout_s,
                )
                return epoch
            await asyncio.sleep(0.02)

    def _unacknowledged(self, epoch: int) -> list[str]:
        live_after = time.time() - 3 * self.interval_s
        return [
            r
            for r in self.store.runtime_keys("replica:")
            if r != self.replica_id
            and (self.store.get_runtime(f"replica:{r}") or {}).get("at", 0) > live_after
            and (self.store.get_runtime(f"weights_seen:{r}") or {}).get("epoch", 0) < epoch
        ]

    async def announce_done(self, epoch: int) -> None:
        """After continue_generation (also after a failed update): publish the version, open every gate."""
        try:
            await asyncio.to_thread(
                self.store.set_runtime,
                "weights",
                {
                    "paused": False,
                    "epoch": epoch,
                    "version": self.gate.version,
                    "at": time.time(),
                    "by": self.replica_id,
                },
            )
            await asyncio.to_thread(self.store.notify_admin)
        finally:
            self.local_update = False
