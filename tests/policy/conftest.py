"""Fixtures of the policy-server tests: a real dev engine behind the real sglang-router (module-scoped),
and policy servers run as subprocesses (``python -m policy_server.cli``) on ephemeral loopback ports,
each stopped by its PID."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.procs import ManagedProcess, free_port, spawn, start_dev_engine, start_router, wait_http

ADMIN_KEY = "admin-secret"
CLIENT_KEY = "client-secret"


def start_policy(model_dir: Path, engine_url: str, data_dir: Path, log_dir: Path, *, name: str = "policy",
                 extra: list[str] | None = None, port: int | None = None) -> ManagedProcess:
    port = port or free_port()
    cmd = [sys.executable, "-m", "policy_server.cli", "--model-path", str(model_dir), "--engine-url", engine_url,
           "--data-dir", str(data_dir), "--port", str(port), "--api-key", CLIENT_KEY,
           "--admin-api-key", ADMIN_KEY, "--engine-deadline-s", "10", "--engine-max-attempts", "3",
           *(extra or [])]
    mp = spawn(name, cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir)
    try:
        wait_http(mp.url + "/health", deadline_s=60, proc=mp.proc)
    except Exception:
        tail = mp.log_tail()
        mp.stop()
        raise RuntimeError(f"policy server failed to start:\n{tail}") from None
    return mp


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
def policy(tiny_model_dir: Path, router: ManagedProcess, engine: ManagedProcess,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """Policy server -> router -> dev engine; weight sync goes to the engine itself."""
    d = tmp_path_factory.mktemp("policy")
    mp = start_policy(tiny_model_dir, router.url, d / "data", d, extra=[
        "--engine-worker-urls", engine.url, "--session-idle-timeout-s", "2", "--idle-sweep-interval-s", "0.2"])
    yield mp
    mp.stop()


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, trust_env=False)


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60, trust_env=False)
