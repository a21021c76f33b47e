"""Fixtures for the PRM framework tests.

``prm_test_scorers`` (next to this file) holds scorer classes that configs reference by dotted path, so the
runner builds and OWNS them exactly as it would user scorers; this folder is put on sys.path for that
(tests use --import-mode=importlib, so test modules themselves are not importable by name).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import prm_test_scorers


@pytest.fixture(autouse=True)
def scorer_log():
    """The shared event log the helper scorers write to, empty for each test."""
    prm_test_scorers.LOG.clear()
    return prm_test_scorers.LOG


@pytest.fixture
def turns3() -> list[dict]:
    return prm_test_scorers.make_turns(3)
