"""Fixtures of the policy-server tests: a real dev engine behind the real sglang-router (module-scoped),
and policy servers run as subprocesses (``python -m policy_server.cli``) on ephemeral loopback ports,
each stopped by its PID."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine, start_router
from tests.testkit.servers import start_routed_policy


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    logs = tmp_path_factory.mktemp("engine-logs")
    mp = start_dev_engine(tiny_model_dir, log_dir=logs, extra_args=["--seed", "0", "--weight-version", "v0"])
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def router(engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    mp = start_router([engine.url], log_dir=tmp_path_factory.mktemp("router-logs"))
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def session_idle_timeout_s() -> float:
    """How long the ``policy`` fixture's sessions stay open without a request. Long: an SDK's tool round trip on
    a loaded machine can take seconds, and a session that idles out between two calls of one run is not paired.
    A module that tests the idle end overrides this fixture."""
    return 300.0


@pytest.fixture(scope="module")
def policy(
    tiny_model_dir: Path,
    router: ManagedProcess,
    engine: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
    session_idle_timeout_s: float,
) -> Iterator[ManagedProcess]:
    """Policy server -> router -> dev engine; weight sync goes to the engine itself."""
    extra = ["--session-idle-timeout-s", str(session_idle_timeout_s), "--idle-sweep-interval-s", "0.2"]
    extra += ["--max-body-bytes", "65536"]
    with start_routed_policy(tiny_model_dir, router, engine, tmp_path_factory.mktemp("policy"), extra=extra) as mp:
        yield mp
