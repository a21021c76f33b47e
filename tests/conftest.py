"""Shared fixtures: tiny models built offline once per session, and per-test run directories.

Area-specific fixtures (engines, routers, servers) live in each area's own conftest.py and use
``engine.procs`` to start real processes on 127.0.0.1 ephemeral ports, stopped by PID.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a hub or an HTTP proxy.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for _var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    os.environ.pop(_var, None)

TEACHER_PREFERRED_TEXT = "Thanks, that worked."


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny policy model (Qwen3 architecture, ChatML template)."""
    from engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-policy"), seed=0)


@pytest.fixture(scope="session")
def teacher_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher with the policy's tokenizer that clearly prefers TEACHER_PREFERRED_TEXT."""
    from engine.tiny_model import build_teacher

    return build_teacher(tiny_model_dir, tmp_path_factory.mktemp("tiny-teacher"), TEACHER_PREFERRED_TEXT, seed=0)


@pytest.fixture(scope="session")
def teacher_preferred_text() -> str:
    return TEACHER_PREFERRED_TEXT


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Per-test folder for logs and data of the processes a test starts."""
    d = tmp_path / "run"
    d.mkdir()
    return d
