"""Client disconnects, shared by the policy server and the judge: notice the hang-up, abort the engine work.

A caller that hangs up must stop the engine work it started. uvicorn does not cancel a handler whose client
hung up (only a StreamingResponse listens for it), so a non-streaming answer would otherwise keep the engine
busy to its last token. :func:`unless_disconnected` runs the work next to a watcher of the ASGI ``receive``
channel; the request body has been read by then, so the next message is ``http.disconnect``, which uvicorn
delivers when the socket closes. On a hang-up the work is cancelled (its engine connections close) and
:class:`ClientGone` is raised; the caller then calls :func:`abort_engine_requests` with the rid prefix its
engine calls used, since SGLang's ``/abort_request`` matches rids by prefix.

Aborts are best effort: cleanup on behalf of a caller that is gone is short (``ABORT_TIMEOUT_S``), never
retried, and never raises. sglang-router 0.3.2 does not fan ``/abort_request`` out and answers 404: that is
logged at info level, and those requests end when the engine notices their closed connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, Protocol, TypeVar

from engine.client import EngineClient
from engine.errors import EngineError, EngineRejected

logger = logging.getLogger(__name__)

T = TypeVar("T")
ABORT_TIMEOUT_S = 2.0
# nginx's "client closed request": logged for the access line; the client that would read it is gone.
CLIENT_CLOSED_STATUS = 499


class ClientGone(Exception):
    """The client hung up before its answer was handed over."""


class _Receives(Protocol):
    """A request whose ASGI ``receive`` callable can be awaited (Starlette's ``Request`` exposes it as a property)."""

    @property
    def receive(self) -> Callable[[], Awaitable[MutableMapping[str, Any]]]: ...


async def wait_for_disconnect(request: _Receives) -> None:
    """Return once the client has hung up. Call only after the body was read in full."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: _Receives, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` unless the client hangs up first: then cancel it, let it unwind, raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (forced shutdown): never orphan the work
        task.cancel()
        watcher.cancel()
        raise
    if watcher.done():  # checked first: work that finished just as the client left was still not delivered
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # unwinds: the engine connections close now
        raise ClientGone
    watcher.cancel()
    return task.result()


async def abort_engine_requests(
    engines: list[EngineClient], rid_prefix: str, *, timeout_s: float = ABORT_TIMEOUT_S
) -> int:
    """``POST /abort_request {"rid": rid_prefix}`` on every engine at once; returns how many acknowledged."""

    async def one(engine: EngineClient) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await engine.abort_request(rid_prefix)
            return True
        except EngineRejected as exc:
            if exc.status_code == 404:  # a router: it does not fan aborts out
                logger.info(
                    "%s has no /abort_request (a router?); %s* end when the engine sees their connections close",
                    engine.base_url,
                    rid_prefix,
                )
            else:
                logger.warning("abort_request %s* refused by %s: %s", rid_prefix, engine.base_url, exc.message)
            return False
        except (EngineError, TimeoutError) as exc:
            logger.warning(
                "abort_request %s* on %s failed (best effort): %s",
                rid_prefix,
                engine.base_url,
                getattr(exc, "message", None) or repr(exc),
            )
            return False

    acked = sum(await asyncio.gather(*(one(e) for e in engines)))
    logger.info("aborted engine requests %s* on %d/%d engine(s)", rid_prefix, acked, len(engines))
    return acked
