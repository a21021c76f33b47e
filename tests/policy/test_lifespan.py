"""Lifespan cleanup: a setup step that fails closes every resource already opened, then re-raises."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import policy_server.app as app_mod
import policy_server.components as components
from policy_server.settings import PolicySettings

pytestmark = pytest.mark.unit


class Boom(RuntimeError):
    pass


def test_failed_setup_closes_what_was_opened(tiny_model_dir, tmp_path, monkeypatch):
    closed: list[str] = []

    class Scoring:  # stands in for a started PRM runner (its own tests build real ones)
        def register(self, registry):
            pass

        async def aclose(self):
            closed.append("prm")

    async def start(path, *, scope="turn"):
        return Scoring()

    class RecordingStore(components.Store):
        def close(self):
            closed.append("store")
            super().close()

    real_http = httpx.AsyncClient

    pools: list[httpx.AsyncClient] = []

    class RecordingHttp(real_http):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            pools.append(self)

        async def aclose(self):
            closed.append("http")
            await super().aclose()

    real_judge = components.JudgeClient

    class RecordingJudge(real_judge):
        async def aclose(self):
            closed.append("judge")
            await super().aclose()

    def fail(*a, **k):
        raise Boom("dispatcher cannot start")

    monkeypatch.setattr(app_mod.PRMScoring, "start", staticmethod(start))
    monkeypatch.setattr(components, "Store", RecordingStore)
    monkeypatch.setattr(httpx, "AsyncClient", RecordingHttp)
    monkeypatch.setattr(components, "JudgeClient", RecordingJudge)
    monkeypatch.setattr(app_mod, "Dispatcher", fail)  # fails after store, http pool and judge client exist
    settings = PolicySettings(
        model_path=str(tiny_model_dir),
        engine_url="http://127.0.0.1:9",
        judge_url="http://127.0.0.1:9",
        data_dir=str(tmp_path / "data"),
        prm_config="x.yaml",
        engine_max_attempts=1,
        engine_deadline_s=1.0,
    )
    app = app_mod.create_app(settings)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(Boom):
        asyncio.run(run())
    # reverse order of creation, nothing left open (the judge client closes its own pool too)
    assert [c for c in closed if c != "http"] == ["judge", "store", "prm"]
    assert pools and all(p.is_closed for p in pools) and closed.count("http") == len(pools)


def test_normal_shutdown_closes_everything(tiny_model_dir, tmp_path, monkeypatch):
    closed: list[str] = []

    class RecordingStore(components.Store):
        def close(self):
            closed.append("store")
            super().close()

    monkeypatch.setattr(components, "Store", RecordingStore)
    settings = PolicySettings(
        model_path=str(tiny_model_dir),
        engine_url="http://127.0.0.1:9",
        data_dir=str(tmp_path / "data"),
        engine_max_attempts=1,
        engine_deadline_s=1.0,
        shutdown_drain_s=0.5,
    )
    app = app_mod.create_app(settings)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            assert app.state.policy.store is not None

    asyncio.run(run())
    assert closed == ["store"]
