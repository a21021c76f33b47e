"""Fixtures of the reliability suite: a real dev engine (module-scoped) and the policy-server test kit.

Policy servers are started per test by the tests themselves (each needs its own settings and data dir),
as subprocesses on ephemeral loopback ports, stopped by their PID."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine
from tests.testkit.servers import JUDGE_KEY, start_judge


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    mp = start_dev_engine(
        tiny_model_dir,
        log_dir=tmp_path_factory.mktemp("engine-logs"),
        extra_args=["--seed", "0", "--weight-version", "v0"],
    )
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """A rules judge that requires ``JUDGE_KEY``."""
    mp = start_judge(tmp_path_factory.mktemp("judge"), args=["--api-key", JUDGE_KEY])
    yield mp
    mp.stop()
