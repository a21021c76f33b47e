"""Configuration and state rules, over HTTP against real policy-server subprocesses: the admin routes
refuse the client key, an api_key without an admin_api_key refuses to start, the reward mode set through
``POST /admin/mode`` survives a restart, ``/ready`` shows its detail only to the admin key, and the data
directory and database are private to the server's user."""

from __future__ import annotations

import stat
import subprocess

import httpx
import pytest

from tests.testkit.servers import admin, client, policy_command, start_policy

pytestmark = pytest.mark.e2e


def test_api_key_without_admin_key_refuses_to_start(tiny_model_dir, tmp_path):
    r = subprocess.run(
        policy_command(str(tiny_model_dir), "http://127.0.0.1:9", "--api-key", "k", "--data-dir", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "admin_api_key" in r.stderr


def test_admin_key_mode_persistence_ready_detail_and_file_modes(tiny_model_dir, engine, run_dir):
    data = run_dir / "data"
    pol = start_policy(tiny_model_dir, engine.url, data, run_dir, name="policy-a")
    try:
        with client(pol.url) as c:
            assert c.post("/admin/mode", json={"mode": "opd"}).status_code == 401
            assert c.get("/v1/samples/lease").status_code == 401
            assert c.post("/admin/weights/update", json={"model_path": "x", "weight_version": "y"}).status_code == 401
        with admin(pol.url) as a:
            r = a.post("/admin/mode", json={"mode": "combine", "w_opd": 0.25})
            assert r.status_code == 200 and r.json()["mode"] == "combine"
            assert a.get("/ready").json()["engine_url"] == engine.url
        public = httpx.get(pol.url + "/ready", timeout=10, trust_env=False).json()
        assert public["ready"] is True and "engine_url" not in public
    finally:
        # A clean exit is asserted, not its speed: on a loaded 2-core machine the drain can outlast stop's
        # default 5 s grace, and the SIGKILL after it would read as a crash.
        pol.stop(grace_s=60)
    assert pol.proc.returncode == 0
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "hindsight.sqlite3").stat().st_mode) == 0o600
    pol = start_policy(tiny_model_dir, engine.url, data, run_dir, name="policy-b")  # --mode rl by default
    try:
        with admin(pol.url) as a:
            assert a.get("/admin/mode").json() == {"mode": "combine", "w_rl": 1.0, "w_opd": 0.25}
    finally:
        pol.stop()


def test_admission_control_sheds_load_with_429(tiny_model_dir, engine, run_dir):
    """Beyond --max-concurrent-requests in flight, requests get 429 + Retry-After; probes still answer."""
    import threading
    import time

    pol = start_policy(
        tiny_model_dir,
        engine.url,
        run_dir / "data",
        run_dir,
        extra=["--max-concurrent-requests", "2", "--max-lease-wait-s", "30"],
    )
    results: list[int] = []
    release = time.monotonic() + 30

    def hold() -> None:  # a lease on an empty queue waits: it stays in flight
        with admin(pol.url) as a:
            results.append(a.get("/v1/samples/lease", params={"max": 1, "wait_s": 4}).status_code)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        with client(pol.url) as c:
            while True:  # poll until both holders are in flight (each answers only after its wait)
                r = c.get("/v1/models")
                if r.status_code == 429 or time.monotonic() > release:
                    break
                time.sleep(0.05)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
            assert httpx.get(pol.url + "/health", timeout=10, trust_env=False).status_code == 200
        for t in threads:
            t.join(timeout=30)
        assert results == [200, 200]
        with client(pol.url) as c:
            assert c.get("/v1/models").status_code == 200  # capacity is back
    finally:
        pol.stop()
