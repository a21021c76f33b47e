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
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from engine.records import ModeSnapshot
from policy_server.errors import StoreBusy
from policy_server.serving.weight_sync import WeightGate

if TYPE_CHECKING:  # types only: the store and reward packages do not import this module back
    from policy_server.rewards.modes import ModeState
    from policy_server.store import SampleStore

logger = logging.getLogger(__name__)


class WeightsAnnouncement(BaseModel):
    """``runtime["weights"]``: whether a weight update pauses the engines now, its epoch (one per update), the
    weight version in force, when and by which replica it was written."""

    model_config = ConfigDict(extra="forbid")

    paused: bool
    epoch: int
    version: str | None
    at: float
    by: str


class WeightsSeen(BaseModel):
    """``runtime["weights_seen:<replica>"]``: the latest pause epoch the replica acknowledged."""

    model_config = ConfigDict(extra="forbid")

    epoch: int


class ReplicaBeat(BaseModel):
    """``runtime["replica:<replica>"]``: the replica's last refresh time and its sessions with a main request in
    flight."""

    model_config = ConfigDict(extra="forbid")

    at: float
    in_flight: list[str]


def _beat_at(beat: ReplicaBeat | None) -> float:
    return 0.0 if beat is None else beat.at


def _seen_epoch(seen: WeightsSeen | None) -> int:
    return 0 if seen is None else seen.epoch


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
        if mode is not None and mode != self.mode_state.snapshot():
            self.mode_state.set(mode.mode, mode.w_rl, mode.w_opd)
            logger.info("reward mode changed at another replica: %s", mode)
        if weights is not None and not self.local_update:
            fresh = time.time() - weights.at < self.max_pause_s
            if weights.paused and fresh:
                if not self._remote_paused:
                    self._remote_paused = True
                    self.gate.close()
                    logger.info("weight update at another replica: new chat requests wait")
                await asyncio.to_thread(
                    self.store.set_runtime, f"weights_seen:{self.replica_id}", WeightsSeen(epoch=weights.epoch)
                )
            else:
                if weights.version is not None:
                    self.gate.version = weights.version
                if self._remote_paused:
                    self._remote_paused = False
                    self.gate.epoch += 1
                    self.gate.open()
                    logger.info("weight update done at another replica: weight_version %s", self.gate.version)
        await asyncio.to_thread(
            self.store.set_runtime,
            f"replica:{self.replica_id}",
            ReplicaBeat(at=time.time(), in_flight=self.in_flight() if self.in_flight else []),
        )

    async def remote_in_flight(self) -> set[str]:
        """Sessions with a main request in flight at another live replica (for the idle sweep)."""
        return await asyncio.to_thread(self._remote_in_flight)

    def _remote_in_flight(self) -> set[str]:
        live_after = time.time() - 3 * self.interval_s
        out: set[str] = set()
        for r in self.store.runtime_keys("replica:"):
            beat = self.store.get_runtime(f"replica:{r}", ReplicaBeat)
            if r != self.replica_id and beat is not None and beat.at > live_after:
                out.update(beat.in_flight)
        return out

    def _read(self) -> tuple[ModeSnapshot | None, WeightsAnnouncement | None]:
        return self.store.get_runtime("mode", ModeSnapshot), self.store.get_runtime("weights", WeightsAnnouncement)

    async def leave(self) -> None:
        """At shutdown: this replica no longer counts as live (an update does not wait for its acknowledgement)."""
        for key in (f"replica:{self.replica_id}", f"weights_seen:{self.replica_id}"):
            await asyncio.to_thread(self.store.delete_runtime, key)

    # ------------------------------------------------------------------ the updating replica
    async def announce_pause(self) -> int:
        """Before the engines pause: every live replica holds new requests (acknowledged, bounded wait)."""
        self.local_update = True
        current = await asyncio.to_thread(self.store.get_runtime, "weights", WeightsAnnouncement)
        epoch = (0 if current is None else current.epoch) + 1
        await asyncio.to_thread(self.store.set_runtime, "weights", self._announcement(paused=True, epoch=epoch))
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
            and _beat_at(self.store.get_runtime(f"replica:{r}", ReplicaBeat)) > live_after
            and _seen_epoch(self.store.get_runtime(f"weights_seen:{r}", WeightsSeen)) < epoch
        ]

    def _announcement(self, *, paused: bool, epoch: int) -> WeightsAnnouncement:
        return WeightsAnnouncement(
            paused=paused, epoch=epoch, version=self.gate.version, at=time.time(), by=self.replica_id
        )

    async def announce_done(self, epoch: int) -> None:
        """After continue_generation (also after a failed update): publish the version, open every gate."""
        try:
            await asyncio.to_thread(self.store.set_runtime, "weights", self._announcement(paused=False, epoch=epoch))
            await asyncio.to_thread(self.store.notify_admin)
        finally:
            self.local_update = False
