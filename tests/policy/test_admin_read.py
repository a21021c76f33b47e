"""The non-consuming admin read ``GET /v1/samples`` and the ``constrained`` flag of forced tool calls.

Policy server -> dev engine, judged by the real judge service (rules backend), all on loopback ports."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import WEATHER_TOOLS, admin, client, judged_policy_stack, policy_command
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

TOOLS = WEATHER_TOOLS


@pytest.fixture(scope="module")
def judged_policy(tiny_model_dir, engine, tmp_path_factory) -> Iterator[ManagedProcess]:
    # A key naming exactly one session (split off): a rewritten history is then a mismatch the view must show.
    work = tmp_path_factory.mktemp("judged-policy")
    with judged_policy_stack(tiny_model_dir, engine.url, work, ["--no-split-diverged-sessions"]) as (pol, _judge):
        yield pol


def _chat(url: str, sid: str, messages: list[dict], headers: dict | None = None, **kw) -> dict:
    with client(url) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, **kw},
            headers={"X-Session-Id": sid, **(headers or {})},
        )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _rows(url: str, **params) -> list[dict]:
    with admin(url) as a:
        r = a.get("/v1/samples", params=params)
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def _settled(url: str, sid: str, n: int, timeout_s: float = 30.0) -> list[dict]:
    def judged() -> list[dict] | None:
        rows = _rows(url, session_id=sid)
        return rows if len(rows) >= n and all(r["status"] != "pending_judge" for r in rows) else None

    return wait_until(
        judged,
        timeout_s=timeout_s,
        interval_s=0.2,
        message=lambda: f"samples of {sid} not judged in time: {_rows(url, session_id=sid)}",
    )


def test_list_samples_is_a_non_consuming_read(judged_policy):
    url = judged_policy.url
    u = [{"role": "user", "content": "list the files"}]
    a = _chat(url, "read-1", u)
    _chat(
        url,
        "read-1",
        u + [{"role": "assistant", "content": a["content"]}, {"role": "user", "content": "thanks, that worked"}],
    )
    b = _chat(url, "read-2", u)
    # a rewritten history: read-2's first turn is rejected with a reason
    _chat(
        url,
        "read-2",
        [
            {"role": "user", "content": "something else"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "ok"},
        ],
    )
    assert b is not None
    rows = _settled(url, "read-1", 1)
    assert [r["turn_index"] for r in rows] == [0] and rows[0]["status"] == "ready"
    sample = rows[0]["sample"]
    assert sample["sample_id"] == rows[0]["sample_id"] and sample["reward"] == 1.0
    assert len(sample["response_ids"]) == len(sample["rollout_logprobs"]) == len(sample["loss_mask"])
    # the distribution the tokens were drawn from is recorded explicitly, client defaults included
    assert sample["sampling_params"]["temperature"] == 1.0 and sample["sampling_params"]["top_p"] == 1.0
    assert sample["sampling_params"]["max_new_tokens"] == 8
    # the admin view shows the turn's next state (typed by role) and its pairing note
    assert rows[0]["turn"] == {
        "pairing": "paired",
        "pairing_note": None,
        "next_state": [{"role": "user", "content": "thanks, that worked"}],
        "session_rule": "header",
        "session_decision": "started",
    }
    rejected = _rows(url, session_id="read-2", status="rejected")
    assert [(r["turn_index"], r["reject_reason"]) for r in rejected] == [(0, "history_mismatch")]
    assert rejected[0]["sample"] is None
    assert rejected[0]["turn"]["pairing"] == "mismatch" and rejected[0]["turn"]["next_state"] is None
    assert "rewritten" in rejected[0]["turn"]["pairing_note"]
    # reading twice changes nothing, and the trainer still leases the sample afterwards
    assert _rows(url, session_id="read-1") == rows
    with admin(url) as adm:
        lease = adm.get("/v1/samples/lease", params={"max": 100}).json()
        assert rows[0]["sample_id"] in {s["sample_id"] for s in lease["samples"]}
        assert {r["status"] for r in _rows(url, status="leased")} >= {"leased"}
        assert adm.post("/v1/samples/ack", json={"lease_id": lease["lease_id"]}).status_code == 200
    assert _rows(url, session_id="read-1")[0]["status"] == "consumed"
    assert len(_rows(url, limit=1)) == 1


def test_list_samples_bad_input(judged_policy):
    url = judged_policy.url
    with client(url) as c:  # the client key is not the admin key
        assert c.get("/v1/samples").status_code == 401
    with admin(url) as a:
        r = a.get("/v1/samples", params={"status": "eaten"})
        assert r.status_code == 400 and "status must be one of" in r.json()["error"]["message"]
        assert a.get("/v1/samples", params={"limit": 0}).status_code == 400
        assert a.get("/v1/samples", params={"limit": "many"}).status_code == 400


def test_forced_tool_call_sample_is_marked_constrained(judged_policy):
    url = judged_policy.url
    u = [{"role": "user", "content": "weather in Paris?"}]
    m = _chat(
        url,
        "forced",
        u,
        tools=TOOLS,
        max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = m["tool_calls"]
    _chat(
        url,
        "forced",
        u
        + [
            {"role": "assistant", "content": m["content"], "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, thanks"},
        ],
        tools=TOOLS,
        headers={"X-Session-Done": "true"},
    )
    free = [{"role": "user", "content": "hello"}]
    f = _chat(url, "free", free, tools=TOOLS, tool_choice="auto")
    _chat(
        url,
        "free",
        free
        + [
            {"role": "assistant", "content": f["content"], "tool_calls": f.get("tool_calls")}
            if f.get("tool_calls")
            else {"role": "assistant", "content": f["content"]},
            {"role": "user", "content": "thanks"},
        ],
    )
    forced = _settled(url, "forced", 2)
    assert forced[0]["status"] == "ready" and forced[0]["sample"]["constrained"] is True
    # turn 1 (free choice, session done) is settled too; when judged it says constrained false
    if forced[1]["sample"] is not None:
        assert forced[1]["sample"]["constrained"] is False
    free_rows = _settled(url, "free", 1)
    assert free_rows[0]["sample"]["constrained"] is False


def test_client_temperature_is_recorded(judged_policy):
    url = judged_policy.url
    u = [{"role": "user", "content": "pick a city"}]
    a = _chat(url, "temp", u, temperature=0.7, top_p=0.9)
    _chat(url, "temp", u + [{"role": "assistant", "content": a["content"]}, {"role": "user", "content": "thanks"}])
    sp = _settled(url, "temp", 1)[0]["sample"]["sampling_params"]
    assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9


def test_refuses_to_listen_beyond_loopback_without_a_key(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        policy_command(str(tiny_model_dir), "http://127.0.0.1:9", "--data-dir", str(tmp_path), "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "without an API key" in proc.stderr
