"""Engine-area fixtures: real dev-engine processes on 127.0.0.1, started once and stopped by PID.

``dev_engine`` is shared read-only by the invariant tests (never update its weights or leave it paused);
tests that change engine state start their own engine (see test_control_e2e.py, test_router_e2e.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as the tiny model, different (seed 1) weights."""
    from devkit.model_cache import copy_of
    from tests.testkit import cached_models

    return copy_of(cached_models.other_policy(), tmp_path_factory.mktemp("models") / "tiny-other")


@pytest.fixture(scope="session")
def dev_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    logs = tmp_path_factory.mktemp("engine-logs")
    with start_dev_engine(tiny_model_dir, log_dir=logs, extra_args=["--served-model-name", "tiny"]) as mp:
        yield mp
