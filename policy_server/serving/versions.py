"""Safe live updates: which weights the engines serve, as the ledger says (push, promote, roll back).

Role: the one place that changes both the engines' weights (policy_server.serving.weight_sync) and the
weight-version ledger (policy_server.store.versions), in an order that keeps them consistent:

- :meth:`VersionControl.push` (``POST /admin/weights/update``): the version is recorded ``candidate`` first
  (refused 409 when another version is pending at any replica, or when its parent is not the live version:
  after a rollback the trainer must restart from the restored weights and name them as parent), then loaded, then made ``canary``
  (``safe_updates``: it must prove itself, policy_server.serving.canary) or ``live``. A load that fails
  forgets the candidate: the engines still serve the previous weights. A candidate that a rollback at another
  replica rolled back while it loaded is refused (409 ``weights_rolled_back``) and the engines it was loaded on
  take the live version's weights back. A push of a version that is already live or canary with the same
  checkpoint (a trainer resuming) only reloads it.
- :meth:`VersionControl.promote`: the canary becomes live (409 ``no_canary`` without one); with a canary
  engine the other engines load its checkpoint first.
- :meth:`VersionControl.rollback`: the engines load the target's checkpoint (default: the live version, i.e.
  the canary is dropped), then the ledger makes it live and every newer live or canary version
  ``rolled_back``: 404 for a version never recorded, 409 for one that cannot be restored.

The engines are loaded before the ledger changes (a crash between the two leaves the ledger naming the
previous state; :meth:`VersionControl.start` logs such a mismatch at startup).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine.client import EngineClient
from engine.records import Sample, VersionState, WeightVersion
from policy_server.errors import Conflict, NotFound
from policy_server.serving.weight_sync import WeightSync
from policy_server.store import SampleStore, UnknownVersion, VersionConflict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Push:
    """A trainer's weight push: the checkpoint, its version, the version it was trained from and its samples."""

    model_path: str
    weight_version: str
    parent: str | None = None
    sample_count: int | None = None
    sample_id_min: str | None = None
    sample_id_max: str | None = None


@dataclass(frozen=True)
class PushOutcome:
    """What a push did: the ledger row and how long the engines were paused."""

    version: WeightVersion
    paused_s: float


def flag_rolled_back(samples: list[Sample], rolled_back: set[str]) -> list[Sample]:
    """The samples, each one that any rolled-back version sampled part of marked ``rolled_back``."""
    if not rolled_back:
        return samples
    return [
        s.model_copy(update={"rolled_back": True})
        if {s.weight_version, *(s.weight_versions or [])} & rolled_back
        else s
        for s in samples
    ]


def _conflict(exc: VersionConflict) -> Conflict:
    return Conflict(str(exc), code=exc.code)


class VersionControl:
    """Pushes, promotions and rollbacks over the engines and the ledger (see the module docstring).

    ``canary_workers``: the engines a canary is loaded on (empty: every engine, the one-engine mode where the
    canary serves all traffic); ``safe_updates``: a push becomes canary rather than live."""

    def __init__(
        self,
        store: SampleStore,
        weight_sync: WeightSync,
        *,
        safe_updates: bool,
        canary_workers: list[EngineClient] | None = None,
        stale_candidate_s: float = 600.0,
    ):
        self.store = store
        self.weight_sync = weight_sync
        self.safe_updates = safe_updates
        self.canary_workers = canary_workers or []
        self.stale_candidate_s = stale_candidate_s
        self._lock = asyncio.Lock()  # one ledger change at a time at this replica (the store's index: at all)
        self.after_change: Callable[[], Awaitable[None]] | None = None  # the canary router re-reads the ledger
        self.on_state: Callable[[dict[str, str]], None] | None = None  # metrics: state -> version (live, canary)

    async def settled(self) -> None:
        """Return once no push, promotion or rollback runs at this replica (a new session is pinned after it), or
        after the weight gate's timeout (as long as a request waits at the gate)."""
        if self._lock.locked():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.weight_sync.gate.timeout_s), self._lock:
                    pass

    @property
    def stable_workers(self) -> list[EngineClient]:
        """The engines that serve the live version while a canary runs."""
        return [w for w in self.weight_sync.workers if w not in self.canary_workers]

    async def start(self, checkpoint: str) -> WeightVersion:
        """At startup: the live version (the engines' current weights are recorded as live in a new ledger)."""
        version = self.weight_sync.gate.version or "base"
        live = await asyncio.to_thread(self.store.ensure_live, version, checkpoint)
        pending = await asyncio.to_thread(self.store.version_in_state, "canary")
        self._publish(live, pending)
        served = {live.version} | ({pending.version} if pending else set())
        if self.weight_sync.gate.version is not None and self.weight_sync.gate.version not in served:
            logger.warning(
                "the engines serve weight version %s but the ledger's live version is %s: an update or rollback "
                "was cut short; roll back to %s to make them agree",
                self.weight_sync.gate.version,
                live.version,
                live.version,
            )
        return live

    async def push(self, push: Push) -> PushOutcome:
        if self.weight_sync.busy or self._lock.locked():
            raise Conflict("a weight update is in progress; retry when it is done", code="update_in_progress")
        async with self._lock:
            same = await asyncio.to_thread(self.store.get_version, push.weight_version)
            if same is not None and same.state in ("live", "canary") and same.checkpoint == push.model_path:
                workers = self.canary_workers if same.state == "canary" and self.canary_workers else None
                result = await self.weight_sync.update(push.model_path, push.weight_version, workers)
                return PushOutcome(same, result.paused_s)
            now = time.time()
            row = WeightVersion(
                version=push.weight_version,
                checkpoint=push.model_path,
                parent=push.parent,
                created_at=now,
                updated_at=now,
                sample_count=push.sample_count,
                sample_id_min=push.sample_id_min,
                sample_id_max=push.sample_id_max,
            )
            try:
                await asyncio.to_thread(self.store.add_version, row, stale_after_s=self.stale_candidate_s)
            except VersionConflict as exc:
                raise _conflict(exc) from None
            workers = self.canary_workers if self.safe_updates and self.canary_workers else None
            try:
                result = await self.weight_sync.update(push.model_path, push.weight_version, workers)
            except BaseException:
                await asyncio.to_thread(self.store.drop_candidate, push.weight_version)
                raise
            state: VersionState = "canary" if self.safe_updates else "live"
            note = "on trial against the live version" if self.safe_updates else "pushed live (safe updates off)"
            try:
                done = await asyncio.to_thread(self.store.finish_push, push.weight_version, state, note)
            except VersionConflict as exc:  # rolled back meanwhile (at another replica): serve the live weights
                live = await asyncio.to_thread(self.store.version_in_state, "live")
                if live is not None:
                    await self.weight_sync.update(live.checkpoint, live.version, workers)
                await self._changed()
                raise _conflict(exc) from None
            logger.info("weight version %s is %s (checkpoint %s)", done.version, done.state, done.checkpoint)
            await self._changed()
            return PushOutcome(done, result.paused_s)

    async def promote(self, note: str = "promoted by an operator") -> WeightVersion:
        if self.weight_sync.busy or self._lock.locked():
            raise Conflict("a weight update is in progress; retry when it is done", code="update_in_progress")
        async with self._lock:
            canary = await asyncio.to_thread(self.store.version_in_state, "canary")
            if canary is None:
                raise Conflict("no version is canary: nothing to promote", code="no_canary")
            if self.canary_workers:  # the other engines take the canary's weights before the ledger says live
                await self.weight_sync.update(canary.checkpoint, canary.version, self.stable_workers)
            try:
                live = await asyncio.to_thread(self.store.promote, note)
            except VersionConflict as exc:
                raise _conflict(exc) from None
            if self.canary_workers:
                self.weight_sync.gate.version = live.version
            logger.info("weight version %s promoted to live: %s", live.version, note)
            await self._changed()
            return live

    async def rollback(self, to: str | None, note: str = "rolled back by an operator") -> list[WeightVersion]:
        if self.weight_sync.busy or self._lock.locked():
            raise Conflict("a weight update is in progress; retry when it is done", code="update_in_progress")
        async with self._lock:
            if to is None:
                live = await asyncio.to_thread(self.store.version_in_state, "live")
                if live is None:
                    raise Conflict("the ledger has no live version to roll back to", code="not_restorable")
                target = live
            else:
                found = await asyncio.to_thread(self.store.get_version, to)
                if found is None:
                    raise NotFound(f"no weight version {to!r} in the ledger", param="to")
                target = found
            if target.state not in ("live", "retired"):
                raise Conflict(
                    f"version {target.version} is {target.state}: only a live or retired version can be restored",
                    code="not_restorable",
                )
            canary = await asyncio.to_thread(self.store.version_in_state, "canary")
            # Only the canary engine changes when the target is the weights the others serve already.
            workers = self.canary_workers if canary and target.state == "live" and self.canary_workers else None
            if target.state == "live" and canary is None and to is None:
                raise Conflict("no version is canary: nothing to roll back", code="no_canary")
            await self.weight_sync.update(target.checkpoint, target.version, workers)
            try:
                changed = await asyncio.to_thread(self.store.roll_back, target.version, note)
            except UnknownVersion as exc:
                raise NotFound(str(exc), param="to") from None
            except VersionConflict as exc:
                raise _conflict(exc) from None
            if workers is not None:
                self.weight_sync.gate.version = target.version
            logger.warning(
                "weights rolled back to %s (%s); rolled back: %s",
                target.version,
                note,
                ", ".join(v.version for v in changed[1:]) or "none",
            )
            await self._changed()
            return changed

    async def _changed(self) -> None:
        live = await asyncio.to_thread(self.store.version_in_state, "live")
        canary = await asyncio.to_thread(self.store.version_in_state, "canary")
        self._publish(live, canary)
        if self.after_change is not None:
            await self.after_change()

    def _publish(self, live: WeightVersion | None, canary: WeightVersion | None) -> None:
        if self.on_state is not None:
            self.on_state({s: v.version for s, v in (("live", live), ("canary", canary)) if v is not None})
