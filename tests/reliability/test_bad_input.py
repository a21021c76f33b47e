"""Hostile but fair input, answered 4xx in each API's error shape: never a 5xx, never an echo of the
client's content, nothing recorded for a request that was refused, and the server serves on.

Each case once crashed a real server (500, a cut stream, or a turn recorded for a 500). The policy server
and the judge run as real subprocesses on loopback ports (dev engine + rules judge); requests are HTTP.
Contract: docs/CONTRACTS.md "Hostile input" and engine.http_guard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from policy_server.store import Store
from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import ADMIN_KEY, JUDGE_KEY, admin, client, start_policy

pytestmark = pytest.mark.e2e

MARK = "SECRET-USER-TEXT"  # put into every offending value: no error body may contain it
U = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


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
    # Strict acceptance: wrong JSON types are not coerced, unknown message fields and parts are not dropped.
    ("max_tokens is a string", {"messages": [U], "max_tokens": "8", "user": MARK}),
    ("temperature is a string", {"messages": [U], "temperature": "1", "user": MARK}),
    ("stream is a string", {"messages": [U], "stream": "true", "user": MARK}),
    ("logprobs is a number", {"messages": [U], "logprobs": 1, "user": MARK}),
    ("unknown message field", {"messages": [{**U, "mystery": MARK}]}),
    (
        "image_url content part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": MARK}}]}]},
    ),
    (
        "non-JSON tool-call arguments in the history",
        {
            "messages": [
                U,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": MARK}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "tools": [TOOL],
        },
    ),
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


def test_unsupported_content_part_is_named(policy):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", json=body)
    _assert_openai_error(r)
    assert "image_url" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[0].type"


HUGE = MARK + "x" * (1024 * 1024)  # a 1 MB client value: no answer may carry more than a short prefix of it


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [U], "model": HUGE},
        {"messages": [{"role": HUGE, "content": "hi"}]},
        {"messages": [U], HUGE: 1},
        {"messages": [{**U, HUGE: 1}]},
        {"messages": [U], "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": HUGE}}},
        {"messages": [U], "logit_bias": {HUGE: 1}},
        {"messages": [U], "metadata": {"k": 5, HUGE: "v"}},
    ],
    ids=["model", "role", "unknown-field", "unknown-message-field", "tool-choice-name", "logit-bias-key", "meta"],
)
def test_error_bodies_echo_a_bounded_prefix_of_a_1mb_value(policy, body):
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "echo"})
    assert r.status_code == 400, r.text[:300]
    assert len(r.content) < 2048, f"{len(r.content)} bytes answered"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/responses", {"input": "hi", "model": HUGE}),
        ("/v1/responses", {"input": "hi", "previous_response_id": HUGE}),
        ("/v1/responses", {"input": [{"type": HUGE}]}),
        ("/v1/responses", {"input": "hi", HUGE: 1}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": HUGE, "content": "hi"}]}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": HUGE}]}]}),
        ("/v1/messages", {"max_tokens": 4, "model": HUGE, "messages": [U]}),
        ("/v1/feedback", {"response_id": HUGE, "value": "up"}),
    ],
    ids=["resp-model", "resp-previous", "resp-item-type", "resp-field", "msg-role", "msg-block", "msg-model", "fb-id"],
)
def test_other_api_shapes_echo_a_bounded_prefix_of_a_1mb_value(policy, route, body):
    with client(policy.url) as c:
        r = c.post(route, json=body, headers={"X-Session-Id": "echo-shapes"})
    assert 400 <= r.status_code < 500, r.text[:300]
    assert len(r.content) < 2048, f"{route}: {len(r.content)} bytes answered"


def test_unknown_1mb_lease_id_is_a_short_404(policy):
    with admin(policy.url) as a:
        r = a.post("/v1/samples/ack", json={"lease_id": HUGE})
    assert r.status_code == 404 and len(r.content) < 2048, (r.status_code, len(r.content))


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_non_json_content_type_is_415(policy, judge, ctype):
    body = json.dumps({"messages": [U], "max_tokens": 2})
    with client(policy.url) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"Content-Type": ctype})
        _assert_openai_error(r, 415)
    with admin(policy.url) as a:
        assert (
            a.post("/v1/samples/ack", content='{"lease_id": "x"}', headers={"Content-Type": ctype}).status_code == 415
        )
    r = httpx.post(
        judge.url + "/v1/judge",
        content=json.dumps(JUDGE_REQ),
        trust_env=False,
        timeout=30,
        headers={"Authorization": f"Bearer {JUDGE_KEY}", "Content-Type": ctype},
    )
    assert r.status_code == 415 and r.json()["error"]["type"] == "UnsupportedMediaType"
    with client(policy.url) as c:  # JSON with a charset, or a +json type, is JSON
        for ok_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
            assert c.post("/v1/chat/completions", content=body, headers={"Content-Type": ok_type}).status_code == 200


@pytest.mark.parametrize("path", ["/x" * 50_000, "/tmp/" + "n" * 300], ids=["100k-chars", "300-char-component"])
def test_bad_weight_path_is_400_at_the_policy_server_and_the_engine(policy, engine, path):
    with admin(policy.url) as a:
        r = a.post("/admin/weights/update", json={"model_path": path, "weight_version": "x"})
    assert r.status_code == 400, r.text[:300]
    assert len(r.content) < 2048
    # The dev engine answers as SGLang does: 400 {"success": false, "message"}, never a 500 traceback.
    e = httpx.post(engine.url + "/update_weights_from_disk", json={"model_path": path}, trust_env=False, timeout=30)
    assert e.status_code == 400 and e.json()["success"] is False and len(e.content) < 2048


def test_judge_request_limit_counts_characters_not_bytes(judge):
    def post(content: str) -> httpx.Response:
        item = {**JUDGE_REQ, "response": {"content": content}}
        return httpx.post(
            judge.url + "/v1/judge",
            content=json.dumps(item, ensure_ascii=False).encode(),  # raw UTF-8, not \u escapes
            trust_env=False,
            timeout=60,
            headers={"Authorization": f"Bearer {JUDGE_KEY}", "Content-Type": "application/json"},
        )

    assert post("\u00e9" * 900_000).status_code == 200  # 900k characters, 1.8 MB of UTF-8: under the limit
    assert post("e" * 1_000_001).status_code == 413
