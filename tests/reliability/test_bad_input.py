"""Hostile but fair input, answered 4xx in each API's error shape: never a 5xx, never an echo of the
client's content, nothing recorded for a request that was refused, and the server serves on.

Each case once crashed a real server (500, a cut stream, or a turn recorded for a 500). The policy server
and the judge run as real subprocesses on loopback ports (dev engine + rules judge); requests are HTTP.
Contract: docs/CONTRACTS.md "Hostile input" and engine.http_guard.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from policy_testkit import ADMIN_KEY, admin, client, start_policy

from engine.procs import ManagedProcess, free_port, start_process
from policy_server.store import Store

pytestmark = pytest.mark.e2e

MARK = "SECRET-USER-TEXT"  # put into every offending value: no error body may contain it
U = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
JUDGE_KEY = "judge-key"


def _nested(depth: int) -> dict:
    node: dict = {"v": MARK}
    for _ in range(depth):
        node = {"n": node}
    return node


@pytest.fixture(scope="module")
def policy(
    tiny_model_dir: Path, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    d = tmp_path_factory.mktemp("bad-input-policy")
    mp = start_policy(tiny_model_dir, engine.url, d / "data", d, extra=["--session-idle-timeout-s", "600"])
    mp.extra["data"] = d / "data"
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "judge_server.cli", "--backend", "rules", "--port", str(port), "--api-key", JUDGE_KEY]
    mp = start_process(
        "judge", cmd, url=f"http://127.0.0.1:{port}", log_dir=tmp_path_factory.mktemp("judge"), deadline_s=60
    )
    yield mp
    mp.stop()


CHAT_CASES = [
    ("text part is a number", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    ("text part is null", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("tool_calls is a number", {"messages": [U, {"role": "assistant", "content": MARK, "tool_calls": 5}, U]}),
    ("tool_calls is true", {"messages": [U, {"role": "assistant", "content": MARK, "tool_calls": True}, U]}),
    (
        "tool_choice function is a string",
        {"messages": [U], "tools": [TOOL], "tool_choice": {"type": "function", "function": MARK}},
    ),
    (
        "tool parameters is a string",
        {
            "messages": [U],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": MARK}}],
            "tool_choice": "required",
        },
    ),
    ("extra message field nested 600 deep", {"messages": [{**U, "extra": _nested(600)}]}),
    ("content is an unpaired surrogate", {"messages": [{"role": "user", "content": MARK + "\ud800"}]}),
    ("model is an unpaired surrogate", {"messages": [U], "model": MARK + "\ud800"}),
    ("streamed, model is an unpaired surrogate", {"messages": [U], "model": MARK + "\ud800", "stream": True}),
    ("session_id is an object", {"messages": [U], "session_id": {"a": MARK}}),
    ("body nested 100000 deep", "[" * 100_000),
]


def _assert_openai_error(r: httpx.Response, status: int = 400) -> None:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    assert MARK not in r.text, "an error body must not echo the client's content"


@pytest.mark.parametrize("case,body", CHAT_CASES, ids=[c for c, _ in CHAT_CASES])
def test_chat_bad_input_is_400_and_records_nothing(policy, case, body):
    sid = "bad-" + case.replace(" ", "-")
    with client(policy.url) as c:
        kw = {"content": body} if isinstance(body, str) else {"content": json.dumps(body)}
        r = c.post("/v1/chat/completions", headers={"X-Session-Id": sid, "Content-Type": "application/json"}, **kw)
        _assert_openai_error(r)
        ok = c.post("/v1/chat/completions", json={"messages": [U], "max_tokens": 2})
        assert ok.status_code == 200  # the server serves on
    st = Store(policy.extra["data"])
    try:
        assert st.session(sid) is None and st.awaiting_turn(sid) is None
    finally:
        st.close()


def test_session_header_is_utf8(policy):
    with client(policy.url) as c:
        r = c.post(
            "/v1/chat/completions", json={"messages": [U], "max_tokens": 2}, headers={"X-Session-Id": "café".encode()}
        )
        assert r.status_code == 200, r.text
        assert r.json()["hindsight"]["session_id"] == "café"
        bad = c.post("/v1/chat/completions", json={"messages": [U]}, headers={"X-Session-Id": b"\xff\xfe"})
        _assert_openai_error(bad)


def test_wrong_method_is_405_with_allow(policy):
    with client(policy.url) as c:
        r = c.delete("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405


def test_admin_bad_input(policy):
    with admin(policy.url) as a:
        r = a.get("/v1/samples/lease", params={"wait_s": 0.5})  # empty queue: waits, then answers empty
        assert r.status_code == 200 and r.json()["samples"] == []
        r = a.post("/admin/weights/update", json={"model_path": f"/nonexistent/{MARK}", "weight_version": "x"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model_path"
        assert a.get("/v1/models").status_code == 401  # the admin key is not a client key
    with client(policy.url) as c:
        assert c.get("/v1/samples/stats").status_code == 401  # and the client key is not an admin key


JUDGE_REQ = {"context": [U], "response": {"content": "done"}, "next_state": [{"role": "user", "content": "thanks"}]}


@pytest.mark.parametrize(
    "case,body,status",
    [
        (
            "next state is an unpaired surrogate",
            {**JUDGE_REQ, "next_state": [{"role": "user", "content": MARK + "\ud800"}]},
            400,
        ),
        ("body nested 100000 deep", "[" * 100_000, 400),
        ("extra field nested 600 deep", {**JUDGE_REQ, "context": [{**U, "x": _nested(600)}]}, 400),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "",
)
def test_judge_bad_input_is_4xx(judge, case, body, status):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        judge.url + "/v1/judge",
        content=content,
        trust_env=False,
        timeout=30,
        headers={"Authorization": f"Bearer {JUDGE_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text[:500]
    assert r.json()["error"]["message"] and MARK not in r.text
    ok = httpx.post(
        judge.url + "/v1/judge",
        json=JUDGE_REQ,
        trust_env=False,
        timeout=30,
        headers={"Authorization": f"Bearer {JUDGE_KEY}"},
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route", ["/v1/judge", "/get_reward"])
def test_judge_oversized_unauthenticated_body_is_413_unread(judge, route):
    r = httpx.post(
        judge.url + route,
        content=b"{" + b" " * 3_000_000 + b"}",
        trust_env=False,
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413, r.text[:300]


def test_policy_oversized_unauthenticated_ack_is_413(policy):
    r = httpx.post(
        policy.url + "/v1/samples/ack",
        content=b" " * (9 * 1024 * 1024),
        trust_env=False,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413
    assert ADMIN_KEY not in r.text
