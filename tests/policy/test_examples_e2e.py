"""The client examples of docs/CLIENTS.md (examples/*.py) run as written against the real policy server ->
sglang-router -> dev engine, and each records what it says it records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_server.store import Store
from tests.testkit.servers import CLIENT_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "script, session_prefix",
    [
        ("openai_sdk_chat.py", "sdk-"),
        ("openai_agents_run.py", "agents-"),
        ("langchain_tools.py", "lc-"),
        ("litellm_chat.py", "litellm-"),
    ],
)
def test_example_runs_and_records_its_session(policy, script, session_prefix):
    env = {**os.environ, "HINDSIGHT_URL": policy.url, "HINDSIGHT_API_KEY": CLIENT_KEY}
    res = subprocess.run([sys.executable, str(EXAMPLES / script)], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [
        r
        for r in Store(policy.log_path.parent / "data").list_samples(limit=10_000)
        if r.session_id.startswith(session_prefix)
    ]
    assert rows, f"{script} recorded no turn"
