"""Shared fixtures: tiny models built offline once (devkit.model_cache) and copied per session, and per-test run
directories.

Area-specific fixtures (engines, routers, servers) live in each area's own conftest.py and use the test kit
(tests.testkit) to start real processes on 127.0.0.1 ephemeral ports; each dies with the run. Servers that
tests only read from are shared by the whole session (``rules_judge``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devkit.model_cache import copy_of
from launch.devstack import TEACHER_PREFERRED_TEXT
from tests.testkit import cached_models

# Tests never reach a hub or an HTTP proxy.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for _var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny policy model (Qwen3 architecture and chat template): a private copy of the cached build."""
    return copy_of(cached_models.policy(), tmp_path_factory.mktemp("models") / "tiny-policy")


@pytest.fixture(scope="session")
def teacher_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher with the policy's tokenizer that clearly prefers TEACHER_PREFERRED_TEXT (a cached fine-tuning)."""
    return copy_of(cached_models.teacher(), tmp_path_factory.mktemp("models") / "tiny-teacher")


@pytest.fixture(scope="session")
def teacher_preferred_text() -> str:
    return TEACHER_PREFERRED_TEXT


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Per-test folder for logs and data of the processes a test starts."""
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def rules_judge(tmp_path_factory: pytest.TempPathFactory):
    """One judge server with the deterministic rules backend (m=3) for the session: stateless, so shared by
    every test that only sends it pairs ("thanks"/"worked" +1, "wrong"/"No," -1)."""
    from tests.testkit.servers import start_judge

    mp = start_judge(tmp_path_factory.mktemp("rules-judge"), "judge-rules", m=3)
    yield mp
    mp.stop()


# ---------------------------------------------------------------- store backends
@pytest.fixture(scope="session")
def pg_cluster():
    """One throwaway PostgreSQL cluster for the whole run (tests.testkit.postgres); tests get their own databases."""
    from tests.testkit.postgres import start_pg_cluster

    cluster = start_pg_cluster()
    yield cluster
    cluster.stop()


_pg_db_counter = iter(range(1, 1_000_000))


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    """A fresh empty database of the session cluster (CREATE DATABASE per test keeps tests independent)."""
    cluster = request.getfixturevalue("pg_cluster")
    return cluster.create_database(f"t{os.getpid()}_{next(_pg_db_counter)}")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store URL of each backend: every test using it runs once per backend (one parametrized suite)."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'store'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store_factory(store_url: str):
    """``make(**kw)`` opens (or reopens) the test's store on its backend; every store opened is closed after."""
    from policy_server.store import open_store

    opened = []

    def make(**kw):
        if store_url.startswith("postgresql"):
            kw.pop("synchronous", None)
        store = open_store(store_url, "", **kw)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()  # idempotent: a test may have closed it already


# ---------------------------------------------------------------- parallel runs (pytest-xdist)
@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: `-p no:xdist` runs the suite without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per core. About half of the suite's time is spent waiting on the servers it
    starts, on timers and on child processes, so a worker per core leaves the cores half idle (measured on 2
    cores: 1648 s serial, 1029 s with 4 workers). Each worker starts its own session-shared servers."""
    return 2 * (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` (pyproject's addopts) takes files slow-first: tests.testkit.scheduling."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.testkit.scheduling import SlowFilesFirst

    return SlowFilesFirst(config, log)


# ---------------------------------------------------------------- what `-m unit` selects
# A test that uses a server fixture or is marked ``process`` (it runs a child interpreter) is not a unit test,
# even in a module marked unit: a store suite runs each test on SQLite AND on the PostgreSQL server through
# ``store_url``, and only the first is unit.
SERVER_FIXTURES = frozenset({"pg_cluster", "pg_url"})


def _not_unit(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    on_postgres = callspec is not None and callspec.params.get("store_url") == "postgresql"  # requested lazily
    uses_a_server = on_postgres or not SERVER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
    return uses_a_server or item.get_closest_marker("process") is not None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m unit`` alone, a test file that never names the marker holds no unit test: it is not imported,
    so the inner loop does not pay for the end-to-end modules' imports (agent SDKs, servers) it would deselect."""
    if config.option.markexpr.strip() != "unit" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return "mark.unit" not in collection_path.read_text(encoding="utf-8") or None


@pytest.hookimpl(tryfirst=True)  # before the `-m` selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the ``unit`` marker off tests that use a server or a child process: ``-m unit`` stays a quick
    inner loop. Then move the files that hold a ``slow`` test to the front (stable otherwise): parallel
    workers take files in this order, so the longest ones start first instead of ending the run alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
    for item in filter(_not_unit, items):
        # A marker from the module or class (pytestmark) moves down to that node's other tests.
        for node in item.listchain()[:-1]:
            if any(m.name == "unit" for m in node.own_markers):
                node.own_markers[:] = [m for m in node.own_markers if m.name != "unit"]
                for other in items:
                    if other is not item and node in other.listchain():
                        other.own_markers.append(pytest.mark.unit.mark)
        item.own_markers[:] = [m for m in item.own_markers if m.name != "unit"]
