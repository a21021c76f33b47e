"""The backlog refusal (policy_server.serving.chat_turn.check_backlog): while the store holds
``max_unconsumed_samples`` or more unconsumed samples a main turn is refused with 429 ``rate_limit_error`` and a
``Retry-After`` header (the status clients retry after waiting), counted in ``hindsight_policy_backpressure_total``;
below the limit it passes. The store is read at most once a second. The refusal goes through the policy server's
own error handlers in a tiny in-process app.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI

from policy_server.errors import RETRY_AFTER_S, install_error_handlers
from policy_server.serving.chat_turn import check_backlog
from policy_server.serving.turn_state import ServingState

pytestmark = pytest.mark.unit


class _Store:
    def __init__(self, backlog: int) -> None:
        self.backlog = backlog
        self.reads = 0

    def unconsumed_backlog(self) -> int:
        self.reads += 1
        return self.backlog


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1


def _state(backlog: int, limit: int) -> Any:
    return SimpleNamespace(
        store=_Store(backlog),
        backlog_cache=[0.0, -1e9],
        settings=SimpleNamespace(max_unconsumed_samples=limit),
        metrics=SimpleNamespace(backpressure=_Counter()),
    )


async def _refusal(st: Any) -> httpx.Response:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def turn() -> dict[str, str]:
        await check_backlog(cast(ServingState, st))
        return {"ok": "yes"}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/chat/completions")


async def test_a_full_backlog_is_a_429_with_retry_after() -> None:
    st = _state(backlog=5, limit=5)
    r = await _refusal(st)
    assert r.status_code == 429
    assert r.headers["retry-after"] == str(RETRY_AFTER_S)
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "5 unconsumed samples" in r.json()["error"]["message"]
    assert st.metrics.backpressure.n == 1


async def test_below_the_limit_passes_and_reads_the_store_once_a_second() -> None:
    st = _state(backlog=4, limit=5)
    assert (await _refusal(st)).status_code == 200
    st.store.backlog = 50  # cached for a second: the next turn still sees 4
    assert (await _refusal(st)).status_code == 200
    assert st.store.reads == 1 and st.metrics.backpressure.n == 0
