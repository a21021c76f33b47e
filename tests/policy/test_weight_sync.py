"""Weight sync without downtime: while clients stream a steady flow of chat requests through policy server
-> router -> dev engine, POST /admin/weights/update runs pause -> update_weights_from_disk -> continue on the
engine. Zero failed requests; weight_version increases; later turns carry the new version; generations cut by
the pause (mode abort) are resumed and record both versions."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from policy_server.store import Store
from tests.testkit.servers import admin, client, start_policy
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("pause_mode", ["abort", "retract"])
def test_update_under_steady_traffic(pause_mode, tiny_model_dir, router, engine, tmp_path):
    pol = start_policy(
        tiny_model_dir,
        router.url,
        tmp_path / "data",
        tmp_path,
        name=f"policy-{pause_mode}",
        extra=["--engine-worker-urls", engine.url, "--pause-mode", pause_mode],
    )
    results: list[tuple[int, str | None, float]] = []
    errors: list[str] = []
    stop = threading.Event()

    def worker(i: int) -> None:
        with client(pol.url) as c:
            n = 0
            while not stop.is_set():
                n += 1
                body = {
                    "messages": [{"role": "user", "content": f"steady {i} {n}"}],
                    "max_tokens": 64,
                    "temperature": 1.0,
                    "stream": n % 2 == 0,
                }
                started = time.monotonic()
                try:
                    r = c.post(
                        "/v1/chat/completions", json=body, headers={"X-Session-Id": f"w{i}-{n}", "X-Session-Done": "1"}
                    )
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                    continue
                if r.status_code != 200 or '"error"' in r.text:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                version = r.json()["hindsight"]["weight_version"] if not body["stream"] else None
                results.append((r.status_code, version, started))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(results) >= 8, timeout_s=60)  # steady traffic is flowing
        with admin(pol.url) as a:
            before = Store(tmp_path / "data").stats().turns
            r = a.post("/admin/weights/update", json={"model_path": str(tiny_model_dir), "weight_version": "v1"})
            assert r.status_code == 200, r.text
            t_done = time.monotonic()
            assert r.json()["success"] and r.json()["weight_version"] == "v1" and r.json()["paused_s"] >= 0
        # traffic goes on under the new weights: several requests submitted after the update have finished
        wait_until(lambda: sum(at > t_done and v is not None for _, v, at in results) >= 4, timeout_s=60)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        metrics = httpx.get(pol.url + "/metrics", trust_env=False).text
        pol.stop()
        # restore v0 naming (and the weights) for other tests sharing the engine, even when an assert failed
        httpx.post(
            engine.url + "/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir), "weight_version": "v0"},
            trust_env=False,
            timeout=60,
        )
    assert not errors, errors[:3]
    assert before > 0 and len(results) > before
    later = [v for _, v, at in results if at > t_done and v is not None]  # submitted after the update
    assert later and all(v == "v1" for v in later)
    st = Store(tmp_path / "data")
    turns = [st.get_turn(f"w{i}-{n}", 0) for i in range(4) for n in range(1, 200)]
    turns = [t.to_json() for t in turns if t]
    versions = {tuple(t["weight_versions"]) for t in turns}
    assert ("v0",) in versions and ("v1",) in versions
    for t in turns:
        assert len(t["response_ids"]) == len(t["rollout_logprobs"]) <= 64
    if pause_mode == "abort":
        resumed = [t for t in turns if t["weight_versions"] == ["v0", "v1"]]
        assert resumed, "an in-flight generation must have been cut by the pause and resumed"
        assert "hindsight_policy_resumes_total" in metrics
