"""Fixtures for the PRM framework tests.

``prm_test_scorers`` (next to this file) holds scorer classes that configs reference by dotted path
(``tests.prm.prm_test_scorers.X``, importable from the repository root), so the runner builds and OWNS them
exactly as it would user scorers.
"""

from __future__ import annotations

import pytest

from tests.prm import prm_test_scorers


@pytest.fixture(autouse=True)
def scorer_log():
    """The shared event log the helper scorers write to, empty for each test."""
    prm_test_scorers.LOG.clear()
    return prm_test_scorers.LOG


@pytest.fixture
def turns3() -> list[dict]:
    return prm_test_scorers.make_turns(3)
