"""The policy server on engine.observability: request ids, route metrics on /metrics, redacted startup config."""

from __future__ import annotations

import pytest

from tests.testkit.servers import ADMIN_KEY, CLIENT_KEY, client

pytestmark = pytest.mark.e2e


def test_request_ids_route_metrics_and_redacted_config(policy):
    with client(policy.url) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"X-Request-ID": "req-obs-1", "X-Session-Id": "obs-1", "X-Turn-Type": "side"},
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-obs-1"
        bad = c.post("/v1/chat/completions", json={"messages": []})
        assert bad.status_code == 400 and bad.headers["x-request-id"]
        metrics = c.get("/metrics").text
    line = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("hindsight_policy_http_requests_total{")
        and 'route="/v1/chat/completions"' in ln
        and 'status="200"' in ln
    ]
    assert line and float(line[0].rsplit(" ", 1)[1]) >= 1
    assert any(
        'route="/v1/chat/completions"' in ln and 'status="400"' in ln
        for ln in metrics.splitlines()
        if ln.startswith("hindsight_policy_http_requests_total{")
    )
    assert "hindsight_policy_requests_total" not in metrics  # the old never-incremented counter is gone
    log = policy.log_path.read_text()  # access lines are written before a response's last byte
    assert "policy server resolved config:" in log and "req-obs-1" in log
    assert CLIENT_KEY not in log and ADMIN_KEY not in log  # secrets redacted
