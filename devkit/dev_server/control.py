"""Scheduler-side control state of the dev engine: admission, pause/continue, aborts, weight-update gating.

Contract, modelled on SGLang 0.5.23 (its ``/abort_request`` and control endpoints):

- ``pause_generation`` blocks admission of new requests until ``continue_generation``. Mode ``abort``
  (default) also aborts every running and waiting request: it ends with HTTP 200, its partial output and
  ``finish_reason {"type": "abort", ...}``. Modes ``retract`` and ``in_place`` hold running requests at
  the next token boundary until ``continue_generation``; ``retract`` recomputes the KV cache on resume
  (so a weight update in between is seen), ``in_place`` keeps it (stale KV, exactly as SGLang does).
- ``abort_request`` aborts every request whose rid starts with the given prefix (or all of them).
- ``update_weights_from_disk`` waits until no request is running un-paused (SGLang's writer lock), and
  new requests wait while an update is pending. ``num_paused_requests`` counts requests held by a pause.

Everything here is called from worker threads and from the event loop, so it is guarded by one
``threading.Condition``; waits are bounded by the request being aborted, never by a busy loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(eq=False)
class RequestHandle:
    """Control view of one admitted request (all ``n`` samples share it)."""

    rid: str
    aborted: bool = False
    abort_message: str = ""
    started: bool = False  # past admission (holds a running slot)
    held: bool = False  # waiting at a token boundary because of a retract/in_place pause
    retracted: bool = False  # the KV cache must be recomputed before the next step
    extra_rids: list[str] = field(default_factory=list)  # child rids (n > 1) matched by prefix too

    def matches(self, prefix: str) -> bool:
        return any(r.startswith(prefix) for r in [self.rid, *self.extra_rids])


class EngineControl:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.paused = False
        self.pause_mode = "abort"
        self.updating = 0
        self._requests: list[RequestHandle] = []

    # ------------------------------------------------------------------ request side (worker threads)
    def register(self, handle: RequestHandle) -> None:
        with self._cond:
            self._requests.append(handle)

    def release(self, handle: RequestHandle) -> None:
        with self._cond:
            if handle in self._requests:
                self._requests.remove(handle)
            self._cond.notify_all()

    def admit(self, handle: RequestHandle) -> bool:
        """Block while paused or updating; False when the request was aborted while waiting."""
        with self._cond:
            self._cond.wait_for(lambda: handle.aborted or not (self.paused or self.updating))
            if handle.aborted:
                return False
            handle.started = True
            self._cond.notify_all()
            return True

    def checkpoint(self, handle: RequestHandle) -> bool:
        """Called before each decode step; holds during a pause. False when the request must abort."""
        with self._cond:
            if handle.aborted:
                return False
            if self.paused and self.pause_mode != "abort":
                handle.held = True
                handle.retracted = handle.retracted or self.pause_mode == "retract"
                self._cond.notify_all()
                self._cond.wait_for(lambda: handle.aborted or not self.paused)
                handle.held = False
            return not handle.aborted

    # ------------------------------------------------------------------ control plane
    def pause(self, mode: str) -> None:
        with self._cond:
            self.paused = True
            self.pause_mode = mode
            if mode == "abort":
                for h in self._requests:
                    self._abort(h, "Abort before prefill" if not h.started else "Aborted by pause_generation")
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._cond.notify_all()

    def abort(self, rid_prefix: str, abort_all: bool) -> int:
        with self._cond:
            hits = [h for h in self._requests if abort_all or (rid_prefix and h.matches(rid_prefix))]
            for h in hits:
                self._abort(h, "Abort in waiting queue" if not h.started else "Aborted by abort_request")
            self._cond.notify_all()
            return len(hits)

    def _abort(self, h: RequestHandle, message: str) -> None:
        if not h.aborted:
            h.aborted = True
            h.abort_message = message

    def begin_update(self, abort_all: bool, deadline_s: float) -> int:
        """Wait until no request runs un-held; returns how many are held by a pause. Raises TimeoutError."""
        with self._cond:
            self.updating += 1
            if abort_all:
                for h in self._requests:
                    self._abort(h, "Aborted by update_weights_from_disk")
                self._cond.notify_all()
            ok = self._cond.wait_for(
                lambda: all(h.held or not h.started or h.aborted for h in self._requests), timeout=deadline_s
            )
            if not ok:
                self.updating -= 1
                self._cond.notify_all()
                raise TimeoutError("requests still running; pause generation first")
            return sum(1 for h in self._requests if h.held)

    def end_update(self) -> None:
        with self._cond:
            self.updating -= 1
            self._cond.notify_all()

    def num_requests(self) -> int:
        with self._cond:
            return len(self._requests)

    def request_counts(self) -> tuple[int, int]:
        """(running, queued): registered requests past admission, and those still waiting for it."""
        with self._cond:
            running = sum(1 for h in self._requests if h.started)
            return running, len(self._requests) - running
