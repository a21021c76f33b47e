"""Graceful shutdown of the policy server: refuse new chat turns, finish the ones in flight,
drain judge work for a bounded time, keep the rest pending in the store.

Contract:

- On the first SIGTERM (or SIGINT) :class:`DrainingServer` does NOT stop uvicorn at once: it sets
  :class:`DrainState` ``draining``, so every NEW ``/v1/chat/completions`` request is answered 503 (OpenAI
  error shape, "shutting down") by :class:`DrainMiddleware` and ``/ready`` says 503, while requests already
  in flight (streams included: counted until their last byte) run to the end. When none is left, or after
  ``shutdown_grace_s``, uvicorn's own shutdown runs (listening socket closed, lifespan shutdown). A second
  signal stops at once (uvicorn's behaviour: a second SIGINT forces the exit).
- The lifespan shutdown (policy_server.app) stops the idle sweeper, then lets the dispatcher work for at
  most ``shutdown_drain_s`` (:meth:`policy_server.rewards.dispatch.Dispatcher.shutdown`): judge calls in flight
  complete and are stored; when only retry-backoff work is left it stops early. Workers still running at
  the deadline are cancelled: their sample stays ``pending_judge`` (its outcome is written in ONE
  transaction or not at all), and the next start resumes it. Nothing accepted is in memory only: recorded
  turns and pairings are committed before they are acknowledged.
- The process then exits 0 (policy_server.cli installs a SIGTERM handler so uvicorn's re-raised signal
  does not kill it with -15).
- Hard stop: the first signal also arms a watchdog thread. If the process is still alive ``hard_stop_s``
  after it (grace + drain + a margin; something is stuck, e.g. a worker thread in a store call), it logs
  that and exits 1 with ``os._exit``: SIGTERM always ends the process within a known bound. Nothing is
  lost by it: every accepted turn is committed before it is acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from policy_server.errors import error_body

logger = logging.getLogger(__name__)

DRAINED_PATHS = ("/v1/chat/completions",)


class DrainState:
    """Whether the server is draining, and how many chat requests are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        self.refused = 0
        self.began_at: float | None = None

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.began_at = time.monotonic()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no chat request is in flight; False when ``timeout_s`` passed first."""
        end = time.monotonic() + timeout_s
        while self.inflight > 0:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.05)
        return True


class DrainMiddleware:
    """Pure ASGI: counts chat requests in flight (until the response ends) and refuses new ones when draining."""

    def __init__(self, app: ASGIApp, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in DRAINED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            self.state.refused += 1
            body = json.dumps(
                error_body(
                    503,
                    "the policy server is shutting down; retry on another instance or after its restart",
                    "service_unavailable",
                )
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"connection", b"close"),
                        (b"retry-after", b"5"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains chat requests before the normal shutdown."""

    def __init__(self, config: uvicorn.Config, drain: DrainState, grace_s: float, hard_stop_s: float):
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s
        self.hard_stop_s = hard_stop_s
        self._watchdog: threading.Timer | None = None

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            return

        def force() -> None:
            logger.error("still running %.0fs after the stop signal: forcing the exit", self.hard_stop_s)
            logging.shutdown()
            os._exit(1)

        # A daemon thread: it never keeps a process alive that stopped on its own.
        self._watchdog = threading.Timer(self.hard_stop_s, force)
        self._watchdog.daemon = True
        self._watchdog.start()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._arm_watchdog()
        if self.drain.draining:
            super().handle_exit(sig, frame)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet: nothing to drain
            super().handle_exit(sig, frame)
            return
        self.drain.begin()
        logger.info(
            "%s: draining (%d chat request(s) in flight, grace %.0fs); new chat requests get 503",
            signal.Signals(sig).name,
            self.drain.inflight,
            self.grace_s,
        )
        loop.call_soon_threadsafe(lambda: loop.create_task(self._exit_when_idle()))

    async def _exit_when_idle(self) -> None:
        if not await self.drain.wait_idle(self.grace_s):
            logger.warning(
                "%d chat request(s) still in flight after %.0fs; stopping anyway", self.drain.inflight, self.grace_s
            )
        self.should_exit = True
