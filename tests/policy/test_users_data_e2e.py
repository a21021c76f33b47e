"""Users' data end to end (docs/USERS_DATA.md): a real policy server -> dev engine, judged by the real rules judge,
on SQLite and on PostgreSQL, over HTTP on loopback ports.

Acceptance: opted-out turns (``X-Hindsight-Train: off`` / ``none``, an OpenClaw incognito key) never appear in
``/v1/samples`` and ``none`` keeps no text; planted secrets are absent from the store's bytes (the SQLite files, a
``pg_dump``), from both servers' logs and from the leased samples, and their turn is rejected ``secret``; a
session is deleted during judging, during a lease (its ack then lists the sample as revoked) and after an ack
(the answer lists what was already consumed, with its weight version), by the admin key or by the session's own
deletion token; the audit lists each turn's votes, verdicts, mode and weights. The ``kill -9`` in the middle of
a deletion is tests/policy/test_users_data_store.py (the deleting process is killed inside its transaction).
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import ADMIN_KEY, admin, client, start_judge, start_policy
from tests.waiting import wait_until
from trainer.lease_client.client import PolicyClient

pytestmark = pytest.mark.e2e

SECRETS = {
    "openai": "sk-proj-Zq81uUvT0ab5LmN4pXy7Rs2dK9wEhJ3fPLANT",
    "aws": "AKIAZ7Q3LMN4PXY7RS2D",
    "github": "ghp_Q8w7E6r5T4y3U2i1O0pAsDfGhJkLzXcVbNmQ",
    "key_body": "MIIEowIBAAKCAQEAq8w7E6r5T4y3U2i1PLANTED",
    "password": "Tr0ub4dor&3xyzzyPLANT",
}
PRIVATE_KEY = f"-----BEGIN RSA PRIVATE KEY-----\n{SECRETS['key_body']}\n-----END RSA PRIVATE KEY-----"
OPTED_OUT_TEXT = "my-diary-entry-opted-out-7731"
U = [{"role": "user", "content": "list the files"}]


@pytest.fixture(scope="module")
def judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    mp = start_judge(tmp_path_factory.mktemp("ud-judge"), "judge-users-data")
    yield mp
    mp.stop()


@pytest.fixture
def policy(tiny_model_dir: Path, engine: ManagedProcess, judge: ManagedProcess, store_url: str, tmp_path: Path):
    extra = ["--judge-url", judge.url, "--store-url", store_url, "--session-idle-timeout-s", "300"]
    extra += ["--dispatch-retry-initial-s", "0.2", "--dispatch-retry-max-s", "1"]
    mp = start_policy(tiny_model_dir, engine.url, tmp_path / "data", tmp_path, extra=extra)
    yield mp
    mp.stop()


def _chat(url: str, sid: str | None, messages: list[dict], headers: dict[str, str] | None = None, **body):
    h = {**({"X-Session-Id": sid} if sid else {}), **(headers or {})}
    with client(url) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **body}, headers=h)
    assert r.status_code == 200, r.text
    return r


def _session(url: str, sid: str, first: list[dict], headers: dict[str, str] | None = None) -> str:
    """Two turns: turn 0 gets the user's thanks as its next state; returns the deletion token."""
    r = _chat(url, sid, first, headers)
    reply = r.json()["choices"][0]["message"]["content"] or ""
    _chat(
        url,
        sid,
        [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "thanks, that worked"}],
        headers,
    )
    return r.headers.get("X-Hindsight-Deletion-Token", "")


def _samples(url: str, sid: str) -> list[dict]:
    with admin(url) as a:
        r = a.get("/v1/samples", params={"session_id": sid})
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def _status(url: str, sid: str, turn: int) -> str | None:
    rows = [s for s in _samples(url, sid) if s["turn_index"] == turn]
    return rows[0]["status"] if rows else None


def _delete(url: str, sid: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"X-Hindsight-Deletion-Token": token} if token is not None else {}
    with admin(url) if token is None else client(url) as c:
        r = c.delete(f"/v1/sessions/{sid}", headers=headers)
    return r.status_code, r.json()


def _store_bytes(policy: ManagedProcess, store_url: str, tmp_path: Path) -> bytes:
    if store_url.startswith("postgresql"):
        from devkit.pgcluster import pg_bindir

        return subprocess.run([str(pg_bindir() / "pg_dump"), store_url], capture_output=True, check=True).stdout
    from policy_server.store import sqlite_dir

    directory = sqlite_dir(store_url, tmp_path / "data")
    assert directory is not None
    return b"".join(p.read_bytes() for p in directory.iterdir() if p.is_file())


def test_opt_out_secrets_deletion_and_audit(
    policy: ManagedProcess, judge: ManagedProcess, engine: ManagedProcess, store_url: str, tmp_path: Path
):
    url = policy.url
    run = uuid.uuid4().hex[:8]

    # Opt-out: served, never judged or trained; "none" (and an OpenClaw incognito key) keeps no text at all.
    off, nothing = f"off-{run}", f"none-{run}"
    _session(url, off, [{"role": "user", "content": OPTED_OUT_TEXT + " list the files"}], {"X-Hindsight-Train": "off"})
    _session(url, nothing, [{"role": "user", "content": OPTED_OUT_TEXT + " none"}], {"X-Hindsight-Train": "none"})
    incognito = f"agent:main:dashboard:incognito-{run}"
    _chat(url, None, [{"role": "user", "content": OPTED_OUT_TEXT + " incognito"}], prompt_cache_key=incognito)
    with client(url) as c:
        bad = c.post(
            "/v1/chat/completions", json={"messages": U, "max_tokens": 2}, headers={"X-Hindsight-Train": "maybe"}
        )
    assert bad.status_code == 400 and "X-Hindsight-Train" in bad.text
    with admin(url) as a:
        side = a.get("/v1/side_turns", params={"session_id": off}).json()["side_turns"]
        assert {s["rule"] for s in side} == {"opt_out"} and len(side) == 2
        assert a.get("/v1/side_turns", params={"session_id": nothing}).json()["side_turns"] == []

    # Secrets in a user message and a tool result: redacted before the store, the turn rejected ``secret``.
    sec = f"sec-{run}"
    first = [
        {"role": "user", "content": f"deploy with {SECRETS['openai']} and {SECRETS['aws']}\n{PRIVATE_KEY}"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": f"GITHUB_TOKEN={SECRETS['github']}\npassword: {SECRETS['password']}",
        },
    ]
    _session(url, sec, first)

    # Ordinary sessions: judged and ready.
    gone_after_ack, leased, judging = f"acked-{run}", f"leased-{run}", f"judging-{run}"
    _session(url, gone_after_ack, U)
    wait_until(lambda: _status(url, gone_after_ack, 0) == "ready", timeout_s=60, interval_s=0.1)
    wait_until(lambda: _status(url, sec, 0) == "rejected", timeout_s=60, interval_s=0.1)
    [sec0] = [s for s in _samples(url, sec) if s["turn_index"] == 0]
    assert sec0["reject_reason"].startswith("secret: ")

    # After an ack: the answer lists the sample as consumed, with the weight version the ack named.
    with admin(url) as a:
        lease = a.get("/v1/samples/lease", params={"max": 64}).json()
        leased_samples = list(lease["samples"])
        assert (
            a.post("/v1/samples/ack", json={"lease_id": lease["lease_id"], "weight_version": "v-test"}).status_code
            == 200
        )
    code, out = _delete(url, gone_after_ack)
    assert code == 200 and [c["weight_version"] for c in out["consumed"]] == ["v-test"]
    assert out["deleted"]["turns"] == 2 and _samples(url, gone_after_ack) == []

    # During a lease, by the session's own token: the ack lists the sample as revoked and consumes it not.
    token = _session(url, leased, U)
    assert len(token) == 64
    wait_until(lambda: _status(url, leased, 0) == "ready", timeout_s=60, interval_s=0.1)
    with admin(url) as a:
        lease = a.get("/v1/samples/lease", params={"max": 64}).json()
        leased_samples += lease["samples"]
        ids = {s["sample_id"] for s in lease["samples"] if s["session_id"] == leased}
        assert ids
        assert _delete(url, leased, "0" * 64)[0] == 401  # someone else's token
        with client(url) as c:
            assert c.delete(f"/v1/sessions/{leased}").status_code == 401  # the client key alone is not enough
        code, out = _delete(url, leased, token)
        assert code == 200 and set(out["revoked"]) == ids
        ack = a.post("/v1/samples/ack", json={"lease_id": lease["lease_id"]}).json()
        assert set(ack["revoked"]) == ids and ack["acked"] == len(lease["samples"]) - len(ids)
    trainer = PolicyClient(url, ADMIN_KEY)  # the trainer's own client drops what the (repeated) ack revoked
    trainer.ack(lease["lease_id"])
    assert trainer.revoked == ids

    # During judging: deleted as soon as its turn is paired; nothing of it comes back, and judging goes on.
    _session(url, judging, U)
    assert _delete(url, judging)[0] == 200
    assert _delete(url, judging)[0] == 404  # nothing left
    after = f"after-{run}"
    _session(url, after, U)
    wait_until(lambda: _status(url, after, 0) == "ready", timeout_s=60, interval_s=0.1)
    assert _samples(url, judging) == []

    # Audit: each turn's verdicts, mode and weights.
    with admin(url) as a:
        audit = a.get(f"/v1/sessions/{after}/audit")
        assert audit.status_code == 200, audit.text
        turn0 = audit.json()["turns"][0]
        assert turn0["mode"] == "rl" and turn0["prm"]["votes"] and turn0["w_rl"] == 1.0
        assert a.get(f"/v1/sessions/{sec}/audit").json()["turns"][0]["redacted"]
        assert a.get("/v1/sessions/nobody/audit").status_code == 404
        lease = a.get("/v1/samples/lease", params={"max": 64}).json()
        leased_samples += lease["samples"]
        every = a.get("/v1/samples", params={"limit": 1000}).json()["samples"]

    # Opted-out sessions never appear in /v1/samples; secrets appear nowhere.
    assert not {off, nothing, incognito} & {s["session_id"] for s in every}
    stored = _store_bytes(policy, store_url, tmp_path)
    logs = policy.log_path.read_bytes() + judge.log_path.read_bytes() + engine.log_path.read_bytes()
    leased_text = repr(leased_samples).encode()
    for name, secret in SECRETS.items():
        for where, blob in (("store", stored), ("logs", logs), ("leased samples", leased_text)):
            assert secret.encode() not in blob, f"planted {name} secret found in the {where}"
    assert f"{OPTED_OUT_TEXT} none".encode() not in stored and f"{OPTED_OUT_TEXT} incognito".encode() not in stored
    assert incognito.encode() not in stored
    assert b" 500 " not in policy.log_path.read_bytes()


def test_responses_store_keeps_no_opted_out_answer_and_no_secret(
    policy: ManagedProcess, store_url: str, tmp_path: Path
):
    """``/v1/responses`` with ``store: true``: a ``none`` request stores no answer (its id cannot be continued), and a
    stored answer holds its secrets redacted."""
    url = policy.url
    with client(url) as c:
        r = c.post(
            "/v1/responses",
            json={"input": f"{OPTED_OUT_TEXT} responses", "max_output_tokens": 4, "store": True},
            headers={"X-Hindsight-Train": "none"},
        )
        assert r.status_code == 200, r.text
        follow = c.post(
            "/v1/responses", json={"input": "and?", "max_output_tokens": 2, "previous_response_id": r.json()["id"]}
        )
        assert follow.status_code == 404
        r = c.post(
            "/v1/responses",
            json={"input": f"use {SECRETS['github']} please", "max_output_tokens": 4, "store": True},
            headers={"X-Session-Id": "resp-secret"},
        )
        assert r.status_code == 200, r.text
        follow = c.post(
            "/v1/responses",
            json={"input": "thanks, that worked", "max_output_tokens": 2, "previous_response_id": r.json()["id"]},
        )
        assert follow.status_code == 200, follow.text
    stored = _store_bytes(policy, store_url, tmp_path)
    assert SECRETS["github"].encode() not in stored and f"{OPTED_OUT_TEXT} responses".encode() not in stored
    assert b"[REDACTED:github_token]" in stored
