"""Helpers shared by the policy-server tests (imported by conftest and the test modules)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from engine.procs import ManagedProcess, free_port, spawn, wait_http

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




def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, trust_env=False)


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60, trust_env=False)
