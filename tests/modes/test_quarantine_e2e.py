"""Quarantine end to end: client -> policy server -> policy dev engine; dispatcher -> judge server (rules
backend, guards on) -> sample store; samples read back from the store, the lease and /metrics.

Contract (docs/REWARD_MODES.md "Guards: quarantine and abstain"): a reply a judge guard quarantines is
rejected ``degenerate: <rule>: <detail>`` in every mode (rl, opd, combine); it is never leased and never
promoted by the at-least-one rule, even when it is the session's only judged turn (its next state is
neutral, which at-least-one would otherwise promote); the recorded reply keeps the engine's
``finish_reason``, which reaches the judge, so a reply cut by ``max_tokens`` is quarantined ``truncated``
where that guard is on (it is off by default); the policy server's metrics count the rejections by reason prefix and the
quarantines by rule, and the session that gave no sample.

The replies are made degenerate on purpose with ``logit_bias`` (token 4 is ``!`` in the tiny tokenizer):
``max_tokens`` 24 gives ``!`` x 24 (a judge with ``truncated`` off, the default, sees only
``degenerate``), ``max_tokens`` 2 gives ``!!`` (too short to be degenerate; cut, so ``truncated``).
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.testkit.procs import ManagedProcess, metric_value
from tests.testkit.servers import ADMIN_KEY, start_judge, start_judged_policy
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NEUTRAL = "Now list the folder."  # the rules judge's 0: at-least-one would promote it
BANG = {"4": 100}  # logit_bias: always "!"


def _stack(
    name: str, judge_args: list[str], tiny_model_dir: Path, engine: ManagedProcess, teacher: ManagedProcess, tmp: Path
) -> tuple[ManagedProcess, ManagedProcess]:
    judge = start_judge(tmp, f"{name}-judge", m=3, args=judge_args)
    policy = start_judged_policy(
        *(tiny_model_dir, engine.url, judge.url, tmp / "data", tmp),
        name=name,
        teacher_url=teacher.url,
        extra=["--mode", "rl"],
        client_key=None,
    )
    return judge, policy


@pytest.fixture(scope="module")
def degenerate_policy(tiny_model_dir, policy_engine, teacher_engine, tmp_path_factory) -> Iterator[ManagedProcess]:
    """Judged with the service's default guards (``degenerate`` quarantine, ``truncated`` off)."""
    judge, policy = _stack(
        "q-degenerate", [], tiny_model_dir, policy_engine, teacher_engine, tmp_path_factory.mktemp("qd")
    )
    with judge, policy:
        yield policy


@pytest.fixture(scope="module")
def default_policy(tiny_model_dir, policy_engine, teacher_engine, tmp_path_factory) -> Iterator[ManagedProcess]:
    """Judged with ``truncated`` switched on as well (quarantine), as overlong filtering would run it."""
    args = ["--guards", "truncated=quarantine,degenerate=quarantine"]
    judge, policy = _stack(
        "q-default", args, tiny_model_dir, policy_engine, teacher_engine, tmp_path_factory.mktemp("qt")
    )
    with judge, policy:
        yield policy


def run_session(url: str, max_tokens: int) -> str:
    """Two requests of one session, both biased to ``!``: the first reply gets a neutral next state (the
    session's only judged turn), the second ends the session (no next state)."""
    sid = f"q-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Open the report."}]
    body = {"model": "hindsight-policy", "max_tokens": max_tokens, "temperature": 1.0, "logit_bias": BANG}
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        first = client.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={**body, "messages": messages})
        assert first.status_code == 200, first.text
        reply = first.json()["choices"][0]["message"]
        messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": NEUTRAL}]
        done = {"X-Session-Id": sid, "X-Session-Done": "true"}
        assert client.post("/v1/chat/completions", headers=done, json={**body, "messages": messages}).status_code == 200
    return sid


def judged_rows(data_dir: Path, sid: str) -> list[dict[str, Any]]:
    """The session's two samples (and turn 0's recorded reply) once judged, read from the store read-only."""
    db = data_dir / "hindsight.sqlite3"

    def read() -> list[Any]:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            return conn.execute(
                "SELECT s.turn_index, s.status, s.reject_reason, s.data, t.record FROM samples s JOIN turns t "
                "ON t.session_id=s.session_id AND t.turn_index=s.turn_index WHERE s.session_id=? ORDER BY s.turn_index",
                (sid,),
            ).fetchall()

    rows = wait_until(
        lambda: len(r := read()) == 2 and all(x[1] != "pending_judge" for x in r) and r,
        timeout_s=60,
        interval_s=0.2,
        message=lambda: f"session {sid} not judged: {read()}",
    )
    return [
        {"status": r[1], "reject_reason": r[2], "data": json.loads(r[3]) if r[3] else None, "record": json.loads(r[4])}
        for r in rows
    ]


def set_mode(url: str, mode: str) -> None:
    assert httpx.post(url + "/admin/mode", json={"mode": mode}, headers=ADMIN, trust_env=False).status_code == 200


def leased(url: str) -> list[dict[str, Any]]:
    resp = httpx.get(url + "/v1/samples/lease", params={"max": 64}, headers=ADMIN, trust_env=False)
    assert resp.status_code == 200, resp.text
    samples: list[dict[str, Any]] = resp.json()["samples"]
    return samples


def test_a_degenerate_reply_is_quarantined_in_every_mode(degenerate_policy: ManagedProcess) -> None:
    url, sessions = degenerate_policy.url, []
    for mode in ("rl", "opd", "combine"):
        set_mode(url, mode)
        sid = run_session(url, max_tokens=24)
        sessions.append(sid)
        first, last = judged_rows(degenerate_policy.extra["data_dir"], sid)
        assert first["record"]["response"]["content"] == "!" * 24
        assert first["status"] == "rejected", (mode, first)
        assert first["reject_reason"] == "degenerate: degenerate: one unit repeated 24 times: '!'", mode
        assert first["data"]["mode"] == mode and first["data"]["loss_mask"] == [0] * 24
        if mode != "opd":  # the PRM verdict keeps the votes and the hit for audit
            prm = first["data"]["prm"]
            assert (prm["status"], prm["score"], len(prm["votes"])) == ("quarantined", None, 3)
            assert [g["rule"] for g in prm["guards"]] == ["degenerate"]
        if mode != "rl":
            assert first["data"]["hint"]["status"] == "quarantined" and first["data"]["hint"]["accepted"] is False
        assert (last["status"], last["reject_reason"]) == ("rejected", "no_next_state")
    set_mode(url, "rl")
    assert leased(url) == []  # nothing of these sessions ever becomes leasable
    assert metric_value(url, "hindsight_policy_rejected_samples", reason="degenerate") == 3
    assert metric_value(url, "hindsight_policy_quarantined_samples", rule="degenerate") == 3
    assert metric_value(url, "hindsight_policy_sessions_without_sample") == 3
    stats = httpx.get(url + "/v1/samples/stats", headers=ADMIN, trust_env=False).json()
    assert stats["sessions_without_sample"] == 3 and stats["samples"]["ready"] == 0


def test_finish_reason_length_reaches_the_judge_and_quarantines(default_policy: ManagedProcess) -> None:
    url = default_policy.url
    sid = run_session(url, max_tokens=2)
    first, _ = judged_rows(default_policy.extra["data_dir"], sid)
    assert first["record"]["response"]["content"] == "!!"
    assert first["record"]["response"]["finish_reason"] == "length"  # kept in the stored turn record
    assert first["status"] == "rejected"
    assert first["reject_reason"] == "degenerate: truncated: cut by its length limit (finish_reason=length)"
    assert first["data"]["prm"]["guards"] == [
        {"rule": "truncated", "action": "quarantine", "detail": "cut by its length limit (finish_reason=length)"}
    ]
    assert leased(url) == []
    assert metric_value(url, "hindsight_policy_quarantined_samples", rule="truncated") == 1
    assert metric_value(url, "hindsight_policy_rejected_samples", reason="no_next_state") == 1
