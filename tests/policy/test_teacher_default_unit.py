"""Unit test of the policy server's teacher default (docs/CONTRACTS.md, ``--teacher-url``).

Contract: ``--teacher-url`` has no default (the policy server does not know the judge's engines); with a judge
and a mode that needs a teacher (opd, combine) but no teacher, the server starts, says at start that those
turns are rejected ``no_teacher``, and builds its pipeline without a teacher. In rl mode nothing is said.
"""

from __future__ import annotations

import contextlib
import logging

import httpx
import pytest

from engine.http_client import RetryPolicy
from policy_server.components import build_pipeline
from policy_server.settings import PolicySettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("mode", "warned"), [("opd", True), ("combine", True), ("rl", False)])
async def test_teacherless_opd_is_said_at_start(mode: str, warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    settings = PolicySettings(
        model_path="m", engine_url="http://127.0.0.1:1", judge_url="http://127.0.0.1:2", mode=mode
    )
    assert settings.teacher_url is None
    caplog.set_level(logging.WARNING, logger="policy_server.components")
    async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient() as http:
        _, pipeline = build_pipeline(settings, None, http, RetryPolicy(), stack)
    assert pipeline is not None and pipeline.teacher is None
    assert any("no_teacher" in r.getMessage() for r in caplog.records) is warned
