"""Canary routing and the automatic decision: a new weight version proves itself on live traffic.

Role (with ``--safe-updates``; policy_server.serving.versions makes a push ``canary``):

- Routing (:meth:`Canary.engine_for`): every session is pinned, at its first turn, to a version
  (policy_server.store.versions ``session_pins``, shared by the replicas and durable). While a canary runs
  with two or more engines, the canary is loaded on ONE engine (the last ``--engine-worker-urls`` entry) and
  a new session goes to it with probability ``canary_share`` (a hash of its id, so every replica agrees);
  a session pinned to the canary is served by the canary engine, every other one by the remaining engines
  (the one a hash of its id picks). So a session's turns stay on one version while its version is served,
  and its samples are single-version. Outside a canary, and with one engine, requests go to the engine URL
  as usual; with one engine every new session after a push is the canary's.
- Decision (:meth:`Canary.check`, every ``canary_check_interval_s``): the per-session rewards of the canary
  are compared with the live version's by the always-valid test (engine.sequential): with two
  or more engines against the live sessions pinned since the canary started, with one engine against the
  live version's last ``canary_reference_sessions`` sessions before it. ``promote`` and ``rollback`` go
  through the same path as the admin routes (VersionControl), noted "automatic: ...". Every replica checks;
  a second replica's attempt at the same transition is refused (409) and ignored.

Drain (two or more engines): once the test decides, new sessions get only the surviving version, and the
transition waits until every open session of the losing version is closed (done, or idle longer than the
session idle timeout), at most ``canary_drain_s``; so no session mixes versions. A session still open after
the drain (and, with one engine, a canary session in flight at a rollback) continues on the surviving version:
its later turns carry that version and the test does not count it (policy_server.store.versions).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Literal

from engine.client import EngineClient
from engine.records import CanaryDrain, WeightVersion
from engine.sequential import ArmStats, Comparison, decide, trial_rho
from policy_server.errors import Conflict, StoreBusy
from policy_server.metrics import Metrics
from policy_server.serving.versions import VersionControl
from policy_server.store import SampleStore

logger = logging.getLogger(__name__)

DRAIN_KEY = "canary_drain"


@dataclass(frozen=True)
class CanaryPolicy:
    """The test's parameters (``--canary-*``: their defaults are the settings', docs/SAFE_UPDATES.md explains
    each)."""

    share: float
    alpha: float
    margin: float
    min_sessions: int
    max_sessions: int | None
    reference_sessions: int
    check_interval_s: float
    drain_s: float
    session_idle_s: float


def unit_hash(text: str) -> float:
    """A stable number in [0, 1) for a session id (the same at every replica and after restarts)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


class Canary:
    """Pins sessions, routes them while a canary runs, and decides the canary (see the module docstring)."""

    def __init__(
        self, store: SampleStore, control: VersionControl, policy: CanaryPolicy, metrics: Metrics | None = None
    ):
        self.metrics = metrics
        self.store = store
        self.control = control
        self.policy = policy
        self.rho = trial_rho(policy.alpha, policy.min_sessions)
        self.canary: WeightVersion | None = None
        self.live: WeightVersion | None = None
        self.last: Comparison | None = None  # the latest comparison (GET /admin/weights, metrics)
        self.decisions = 0
        self._pins: dict[str, str] = {}  # session -> version, this replica's cache of the store's pins
        # {"canary", "decision", "at"} once decided with a canary engine: new sessions get the surviving version
        # while the losing version's open sessions finish (runtime DRAIN_KEY, so every replica follows).
        self.drain: CanaryDrain | None = None

    async def refresh(self) -> None:
        self.canary = await asyncio.to_thread(self.store.version_in_state, "canary")
        self.live = await asyncio.to_thread(self.store.version_in_state, "live")
        drain = await asyncio.to_thread(self.store.get_runtime, DRAIN_KEY, CanaryDrain)
        self.drain = drain if self.canary is not None and drain and drain.canary == self.canary.version else None
        if self.canary is None:
            self.last = None
        if self.metrics is not None:
            self.metrics.versions.current = {
                s: v.version for s, v in (("live", self.live), ("canary", self.canary)) if v is not None
            }
            self._publish_comparison()

    def _publish_comparison(self) -> None:
        if self.metrics is None:
            return
        c = self.last
        arms: dict[tuple[str, str], float] = {}
        if c is not None:
            for name, arm in (("canary", c.canary), ("live", c.live)):
                arms.update({(name, "mean"): arm.mean, (name, "lo"): arm.interval.lo, (name, "hi"): arm.interval.hi})
        self.metrics.versions.arms = arms

    async def engine_for(self, session_id: str | None) -> EngineClient | None:
        """The engine a session's turn must go to (None: the engine URL, as without a canary)."""
        if session_id is None or self.live is None:
            return None
        version = self._pins.get(session_id)
        if version is None:
            # Mid-transition the version a new session would get is about to change: pin it after (its request
            # would wait at the closed weight gate anyway).
            await self.control.settled()
            fresh = self.live.version
            if self.canary is not None and self.drain is not None:  # decided: only the surviving version
                fresh = self.canary.version if self.drain.decision == "promote" else self.live.version
            elif self.canary is not None and (
                not self.control.canary_workers or unit_hash(session_id) < self.policy.share
            ):
                fresh = self.canary.version
            version = await asyncio.to_thread(self.store.pin_session, session_id, fresh)
            if len(self._pins) > 100_000:  # a bounded cache: the store holds every pin
                self._pins.clear()
            self._pins[session_id] = version
        workers = self.control.canary_workers
        if self.canary is None or not workers:
            return None
        if version == self.canary.version:
            return workers[0]
        stable = self.control.stable_workers
        return stable[int(unit_hash("engine:" + session_id) * len(stable))]

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
                await self.check()
            except (StoreBusy, Conflict) as exc:  # transient, or another replica made the transition first
                logger.warning("canary check deferred: %s", exc)
            await asyncio.sleep(self.policy.check_interval_s)

    async def comparison(self) -> Comparison | None:
        """The canary against the live version now (None without a canary)."""
        canary, live = self.canary, self.live
        if canary is None or live is None:
            return None
        started = canary.updated_at  # when it became canary
        c = await asyncio.to_thread(self.store.session_rewards, canary.version, since=started)
        if self.control.canary_workers:  # live sessions served next to the canary
            ref = await asyncio.to_thread(self.store.session_rewards, live.version, since=started)
        else:  # one engine: the live version's recent window before the canary
            ref = await asyncio.to_thread(
                self.store.session_rewards, live.version, before=started, limit=self.policy.reference_sessions
            )
        arms = [ArmStats(), ArmStats()]
        for i, rows in enumerate((c, ref)):
            for r in rows:
                arms[i] = arms[i].add(r.reward)
        p = self.policy
        return decide(
            arms[0],
            arms[1],
            alpha=p.alpha,
            margin=p.margin,
            min_sessions=p.min_sessions,
            max_sessions=p.max_sessions,
            rho=self.rho,
        )

    async def check(self) -> None:
        """Compare, and promote or roll back when the test decides."""
        cmp = await self.comparison()
        self.last = cmp
        self._publish_comparison()
        if cmp is None or cmp.decision == "continue" or self.canary is None:
            return
        if self.control.canary_workers and not await self._drained(cmp.decision):
            return
        d = cmp.diff
        note = (
            f"automatic {cmp.decision}: canary - live reward in [{d.lo:.3f}, {d.hi:.3f}] after "
            f"{cmp.canary.sessions} canary and {cmp.live.sessions} live sessions"
        )
        if (self.drain.decision if self.drain else cmp.decision) == "promote":
            await self.control.promote(note=note)
        else:
            await self.control.rollback(None, note=note)
        self.decisions += 1
        if self.metrics is not None:
            self.metrics.canary_decisions.labels(decision=cmp.decision).inc()
        self._pins.clear()  # pins to a version no longer served route to the surviving one
        await asyncio.to_thread(self.store.delete_runtime, DRAIN_KEY)
        await self.refresh()

    async def _drained(self, decision: Literal["promote", "rollback"]) -> bool:
        """With a canary engine: whether the losing version's sessions are all closed (or the drain ran out), the
        drain started (for every replica) at the first decision; the first decision holds until done."""
        assert self.canary is not None and self.live is not None
        if self.drain is None:
            self.drain = CanaryDrain(canary=self.canary.version, decision=decision, at=time.time())
            await asyncio.to_thread(self.store.set_runtime, DRAIN_KEY, self.drain)
            await asyncio.to_thread(self.store.notify_admin)
            logger.info("canary %s decided %s: draining the other version's sessions", self.canary.version, decision)
        losing = self.live.version if self.drain.decision == "promote" else self.canary.version
        active_since = time.time() - self.policy.session_idle_s
        open_n = await asyncio.to_thread(self.store.open_pinned_sessions, losing, active_since)
        if open_n and time.time() - self.drain.at < self.policy.drain_s:
            return False
        if open_n:
            logger.warning(
                "%d session(s) of version %s still open after the drain: they change version", open_n, losing
            )
        return True
