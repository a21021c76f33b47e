"""PolicyClient (trainer/lease_client/client.py): admin API calls, retries within a deadline, no retry on 4xx.

httpx.MockTransport is used only to inject faults (5xx, refused connections, 4xx) into the HTTP calls.
"""

from __future__ import annotations

import json

import httpx
import pytest

from trainer.lease_client import (
    FileSampleSource,
    Lineage,
    PolicyClient,
    PolicyRejected,
    PolicyUnavailable,
    PublishDeferred,
    SourceExhausted,
    WeightsRolledBack,
)

pytestmark = pytest.mark.unit


def make(handler, **kw) -> PolicyClient:
    return PolicyClient("http://policy.test", "adminkey", transport=httpx.MockTransport(handler), **kw)


def test_lease_ack_update_paths_and_auth():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.method, req.url.path, dict(req.url.params), req.headers.get("authorization"), req.content))
        if req.url.path == "/v1/samples/lease":
            return httpx.Response(200, json={"lease_id": "L1", "samples": [{"sample_id": "a"}]})
        if req.url.path == "/v1/samples/ack":
            return httpx.Response(200, json={"acked": 1})
        return httpx.Response(200, json={"success": True, "weight_version": "3", "paused_s": 0.1})

    c = make(handler)
    lease = c.lease(4, 2.5)
    assert lease.lease_id == "L1" and lease.samples == [{"sample_id": "a"}]
    c.ack("L1")
    assert c.update_weights("/ckpt/step_000003", "3").weight_version == "3"
    assert seen[0][:4] == ("GET", "/v1/samples/lease", {"max": "4", "min": "1", "wait_s": "2.5"}, "Bearer adminkey")
    assert seen[1][1] == "/v1/samples/ack" and json.loads(seen[1][4]) == {"lease_id": "L1"}
    assert seen[2][1] == "/admin/weights/update" and json.loads(seen[2][4]) == {
        "model_path": "/ckpt/step_000003",
        "weight_version": "3",
    }


def test_retries_5xx_and_transport_errors_then_succeeds():
    calls = {"n": 0}

    def handler(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            raise httpx.ConnectError("refused", request=req)
        if calls["n"] == 2:
            return httpx.Response(503, json={"detail": "busy"})
        return httpx.Response(200, json={"lease_id": "L", "samples": []})

    assert make(handler, deadline_s=10).lease(1, 0).lease_id == "L"
    assert calls["n"] == 3


def test_4xx_is_not_retried_and_carries_the_message():
    calls = {"n": 0}

    def handler(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(404, json={"detail": "unknown lease L9"})

    with pytest.raises(PolicyRejected, match="unknown lease L9") as ei:
        make(handler).ack("L9")
    assert ei.value.status_code == 404 and calls["n"] == 1


def test_deadline_turns_into_policy_unavailable():
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="bad gateway")

    with pytest.raises(PolicyUnavailable, match="HTTP 502"):
        make(handler, deadline_s=0.6).ack("L")


def test_refused_weight_update_is_an_error():
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"success": False, "message": "load failed"})

    with pytest.raises(Exception, match="refused"):
        make(handler).update_weights("/x", "1")


@pytest.mark.parametrize(
    ("parent_required", "parent", "expected"),
    [
        (True, None, WeightsRolledBack),  # the live version was restored: reload it, whatever the run's lineage
        (True, "gone", WeightsRolledBack),  # a parent the ledger never recorded counts as none
        (False, None, PublishDeferred),  # no rollback: the 409 was another push in progress
        (False, "7", WeightsRolledBack),  # the parent itself was rolled back
    ],
)
def test_a_refused_push_is_read_against_the_ledger(parent_required, parent, expected):
    now = 1.0
    ledger = [
        {"version": "7", "checkpoint": "/c/7", "state": "rolled_back", "created_at": now, "updated_at": now},
        {
            "version": "5",
            "checkpoint": "/c/5",
            "state": "live",
            "created_at": now,
            "updated_at": now,
            "parent_required": parent_required,
        },
    ]

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/admin/weights":
            return httpx.Response(200, json={"live": "5", "canary": None, "versions": ledger})
        return httpx.Response(409, json={"error": {"message": "refused", "code": "parent_required"}})

    with pytest.raises(expected) as ei:
        make(handler).update_weights("/x", "8", Lineage(parent_version=parent))
    if expected is WeightsRolledBack:
        assert (ei.value.live.version, ei.value.live.checkpoint) == ("5", "/c/5")


def test_file_source_persists_ack_cursor_and_forgets_unacked(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"sample_id": str(i)}) + "\n" for i in range(5)))
    state = tmp_path / "state.json"
    src = FileSampleSource(path, state)
    l1 = src.lease(2, 0)
    l2 = src.lease(2, 0)
    src.ack(l1.lease_id)
    with pytest.raises(PolicyRejected):
        src.ack("nope")
    again = FileSampleSource(path, state)  # restart: l2 was never acked, so it is served again
    assert [s["sample_id"] for s in again.lease(10, 0).samples] == ["2", "3", "4"]
    assert [s["sample_id"] for s in l2.samples] == ["2", "3"]
    with pytest.raises(SourceExhausted):
        again.lease(1, 0)
