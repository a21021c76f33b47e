"""Helpers shared by the policy-server tests (imported by conftest and the test modules)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from engine.procs import ManagedProcess, free_port, start_process

ADMIN_KEY = "admin-secret"
CLIENT_KEY = "client-secret"
TEST_MODEL_ALIAS = "m"  # the model name the policy tests' clients send (a client with a name of its own)


def start_policy(
    model_dir: Path,
    engine_url: str,
    data_dir: Path,
    log_dir: Path,
    *,
    name: str = "policy",
    extra: list[str] | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "policy_server.cli",
        "--model-path",
        str(model_dir),
        "--engine-url",
        engine_url,
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "--api-key",
        CLIENT_KEY,
        "--admin-api-key",
        ADMIN_KEY,
        "--engine-deadline-s",
        "10",
        "--engine-max-attempts",
        "3",
        "--model-aliases",
        TEST_MODEL_ALIAS,
        *(extra or []),
    ]
    return start_process(name, cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir, env=env, deadline_s=60)


def pythonpath_with_testkit() -> dict[str, str]:
    """Env for a server process that must import test modules of this folder by dotted path (test scorers)."""
    here = str(Path(__file__).parent)
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": here + (os.pathsep + old if old else "")}


def start_judge(log_dir: Path, name: str, port: int | None = None) -> ManagedProcess:
    """A real judge server with the deterministic rules backend ("thanks"/"worked" +1, "wrong"/"No," -1)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "judge_server.cli", "--backend", "rules", "--host", "127.0.0.1", "--port", str(port)]
    return start_process(
        name, cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir, env={"HINDSIGHT_JUDGE_M": "3"}, deadline_s=60
    )


@contextmanager
def judged_policy_stack(
    model_dir: Path, engine_url: str, work: Path, extra: list[str] | None = None
) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    """A policy server judged by a rules-backend judge (its default settings); yields (policy, judge), stops both."""
    port = free_port()
    judge = start_process(
        "judge",
        [sys.executable, "-m", "judge_server.cli", "--backend", "rules", "--host", "127.0.0.1", "--port", str(port)],
        url=f"http://127.0.0.1:{port}",
        log_dir=work,
        deadline_s=60,
    )
    pol = None
    try:
        pol = start_policy(model_dir, engine_url, work / "data", work, extra=["--judge-url", judge.url, *(extra or [])])
        yield pol, judge
    finally:
        if pol:
            pol.stop()
        judge.stop()


def chat(url: str, sid: str, messages: list[dict], *, max_tokens: int, done: bool = False) -> dict:
    """One main turn of session ``sid``; returns the assistant message."""
    headers = {"X-Session-Id": sid, **({"X-Session-Done": "true"} if done else {})}
    with client(url) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def stats(url: str) -> dict:
    with admin(url) as c:
        r = c.get("/v1/samples/stats")
    assert r.status_code == 200, r.text
    return r.json()


def lease_all(url: str) -> dict:
    """Lease (and ack) every ready sample; returns the lease answer."""
    with admin(url) as c:
        r = c.get("/v1/samples/lease", params={"max": 256, "wait_s": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        if body["lease_id"]:
            assert c.post("/v1/samples/ack", json={"lease_id": body["lease_id"]}).status_code == 200
    return body


def of_session(samples: list[dict], sid: str) -> dict[int, dict]:
    return {s["turn_index"]: s for s in samples if s["session_id"] == sid}


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, trust_env=False)


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60, trust_env=False)
