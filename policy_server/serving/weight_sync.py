"""Weight sync without downtime: a gate for new generations and the update sequence.

Contract (docs/CONTRACTS.md ``POST /admin/weights/update``; SGLang's control endpoints):

1. Close the gate: new engine submissions (new requests and resubmissions of aborted ones) wait at
   :meth:`WeightGate.wait_open`, at most ``gate_timeout_s`` each (then 503 with a message): they are
   delayed, not failed.
2. ``pause_generation(mode)`` on every engine worker URL (the router does not fan these out). Mode
   ``abort`` (SGLang's default) returns in-flight requests as aborted with their partial output; the
   generator resubmits them once the gate opens (policy_server.serving.generation). ``retract``/``in_place``
   hold them inside the engine and resume them after ``continue``.
3. ``update_weights_from_disk(model_path, weight_version)`` on every worker.
4. ``continue_generation`` on every worker (also after a failed step, so the engines never stay paused),
   then open the gate and bump the epoch. The result is ``{"success", "weight_version", "paused_s"}``;
   a failed step raises with the workers that failed named: 400 when every failing engine refused the
   request itself (EngineRejected, e.g. a model_path that does not exist), else 502.
Only one update runs at a time: a second one, sent while the first runs, is refused (409 ``Conflict``, code
``update_in_progress``) rather than queued, since it would load weights trained without the first's outcome
(policy_server.serving.versions refuses it across replicas too). With replicas on a shared store,
step 1 also closes the gate of every replica and step 4 opens them and gives them the new version
(policy_server.serving.replicas), so no replica sends work into a paused engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Protocol

from engine.client import EngineClient
from engine.errors import EngineError, EngineRejected
from engine.records import WeightsUpdated
from policy_server.errors import Conflict, InvalidRequest, ServiceUnavailable, UpstreamFailed

logger = logging.getLogger(__name__)


class PauseAnnouncer(Protocol):
    """The replicas' side of an update (policy_server.serving.replicas.ReplicaSync has it): every replica holds
    new requests before the engines pause, and learns the new version after."""

    async def announce_pause(self) -> int: ...

    async def announce_done(self, epoch: int) -> None: ...


class WeightGate:
    """Open except during an update. ``epoch`` counts completed updates; ``version`` is the current one."""

    def __init__(self, timeout_s: float, version: str | None = None):
        self.timeout_s = timeout_s
        self.version = version
        self.epoch = 0
        self.waiting = 0
        self._open = asyncio.Event()
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        if self._open.is_set():
            return
        self.waiting += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._open.wait()
        except TimeoutError:
            raise ServiceUnavailable(
                f"weight update in progress for more than {self.timeout_s:.0f}s; retry shortly"
            ) from None
        finally:
            self.waiting -= 1


class WeightSync:
    """Runs pause -> update_weights_from_disk -> continue on every worker behind the gate."""

    def __init__(
        self,
        workers: list[EngineClient],
        gate: WeightGate,
        *,
        pause_mode: str = "abort",
        deadline_s: float = 600.0,
        replicas: PauseAnnouncer | None = None,
    ):
        self.workers = workers
        self.replicas = replicas  # with a shared store (several replicas), else None
        self.gate = gate
        self.pause_mode = pause_mode
        self.deadline_s = deadline_s
        self._lock = asyncio.Lock()
        self.updates = 0
        self.failures = 0
        self.last_paused_s = 0.0

    @property
    def busy(self) -> bool:
        """An update is running at this replica."""
        return self._lock.locked()

    async def _all(
        self,
        step: str,
        calls: list[Awaitable[object]],
        errors: list[BaseException] | None = None,
        workers: list[EngineClient] | None = None,
    ) -> list[str]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = []
        for w, r in zip(workers or self.workers, results, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, (EngineError, TimeoutError)):
                    raise r
                logger.error("%s failed on %s: %s", step, w.base_url, r)
                failed.append(f"{w.base_url}: {r}")
                if errors is not None:
                    errors.append(r)
        return failed

    async def update(
        self, model_path: str, weight_version: str, workers: list[EngineClient] | None = None
    ) -> WeightsUpdated:
        """Load ``model_path`` as ``weight_version`` on ``workers`` (default: every worker); Conflict while another
        update runs. The gate and the replicas' pause cover every worker either way (one short pause)."""
        if self._lock.locked():
            raise Conflict("a weight update is in progress; retry when it is done", code="update_in_progress")
        targets = workers or self.workers
        async with self._lock:
            self.gate.close()
            t0 = time.monotonic()
            failed: list[str] = []
            errors: list[BaseException] = []
            step = "pause_generation"
            epoch = None
            try:
                if self.replicas is not None:  # every replica holds new requests before the engines pause
                    epoch = await self.replicas.announce_pause()
                failed = await self._all(step, [w.pause_generation(self.pause_mode) for w in self.workers])
                if not failed:
                    step = "update_weights_from_disk"
                    failed = await self._all(
                        step,
                        [
                            w.update_weights_from_disk(
                                model_path, weight_version=weight_version, deadline_s=self.deadline_s
                            )
                            for w in targets
                        ],
                        errors,
                        targets,
                    )
            finally:
                cont = await self._all("continue_generation", [w.continue_generation() for w in self.workers])
                if not failed and not cont:
                    if targets is self.workers:  # the version every engine serves
                        self.gate.version = weight_version
                    self.updates += 1
                self.gate.epoch += 1
                self.gate.open()
                if self.replicas is not None and epoch is not None:
                    await self.replicas.announce_done(epoch)
                paused_s = time.monotonic() - t0
                self.last_paused_s = paused_s
            if failed or cont:
                self.failures += 1
                msg = "; ".join(failed or cont)
                if failed and not cont and all(isinstance(e, EngineRejected) for e in errors):
                    # Every engine refused the request itself (e.g. a model_path that does not exist): the
                    # caller's error, not an upstream fault; generation continues on the old weights.
                    raise InvalidRequest(f"weight update refused by the engine(s): {msg}", param="model_path")
                raise UpstreamFailed(f"weight update failed at {step if failed else 'continue_generation'}: {msg}")
            logger.info(
                "weights updated to %s from %s in %.3fs (pause mode %s)",
                weight_version,
                model_path,
                paused_s,
                self.pause_mode,
            )
            return WeightsUpdated(success=True, weight_version=weight_version, paused_s=round(paused_s, 4))


__all__ = ["WeightGate", "WeightSync", "ServiceUnavailable"]
