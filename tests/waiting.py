"""Waiting on an observable condition in tests: poll a predicate until it holds or a deadline passes.

Tests synchronise on conditions they can observe (a store row, a server's /ready, a counter in a fake), never
on a fixed sleep: a sleep is either too short on a loaded machine (flaky) or longer than needed (slow).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Message = str | Callable[[], object]  # a callable is evaluated at the timeout, so it can report the last state


def _fail(message: Message, timeout_s: float) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"{text} (waited {timeout_s:.1f}s)")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    message: Message = "condition not reached in time",
) -> T:
    """The predicate's first truthy value, polled every ``interval_s``; AssertionError after ``timeout_s``
    (with ``message``, or what it returns when it is a callable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _fail(message, timeout_s)
        time.sleep(interval_s)


async def async_wait_until(
    predicate: Callable[[], Awaitable[T] | T],
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    message: Message = "condition not reached in time",
) -> T:
    """``wait_until`` inside an event loop: the predicate may be sync or async; the loop keeps running between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _fail(message, timeout_s)
        await asyncio.sleep(interval_s)
