"""Every reward mode end to end: client -> policy server -> policy dev engine; dispatcher -> judge server
(rules backend) -> teacher dev engine. Samples are read back from the policy server's store and leased
through the admin API.

Contract (docs/REWARD_MODES.md, docs/CONTRACTS.md "Sample JSON"): exact loss masks, rewards and
presence flags per mode and verdict; the mode is switched at runtime through POST /admin/mode and each
sample records the mode it was judged under; teacher log-probs have one entry per sampled response id,
the first one real, equal to a torch recomputation with the teacher checkpoint on the hint-augmented
prompt (1e-4), with top-K rows [T][K]; at-least-one over sessions of all-neutral turns, of a mix, and of
judge failures (a second policy server whose judge has no working engine); the last turn of a session
is rejected ``no_next_state``; only ready samples are leased.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.numerics import logprob_atol
from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import ADMIN_KEY, start_judged_policy
from tests.waiting import wait_until

# The teacher reads the policy's prompt plus the hint: a bound on the positions that adds for the tolerance
# (it enters under a square root, so a generous bound costs little).
HINT_POSITIONS = 256

pytestmark = pytest.mark.e2e

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOP_K = 3
POSITIVE = "Thanks, that worked."
NEGATIVE = "No, that is wrong. Use the other file in /tmp."
NEUTRAL = "Now list the folder."


@pytest.fixture(scope="module")
def judged_policy(tiny_model_dir, policy_engine, teacher_engine, modes_log_dir, tmp_path_factory):
    """``start(judge, name)``: a policy server of these tests judged by ``judge``; all stop with the module."""
    with ExitStack() as started:

        def start(judge: ManagedProcess, name: str) -> ManagedProcess:
            data = tmp_path_factory.mktemp(f"{name}-data")
            mp = start_judged_policy(
                *(tiny_model_dir, policy_engine.url, judge.url, data, modes_log_dir),
                name=name,
                teacher_url=teacher_engine.url,
                extra=["--mode", "rl", "--w-rl", "1.0", "--w-opd", "0.5", "--teacher-top-k", str(TOP_K)],
                client_key=None,
                fail_fast=False,
            )
            return started.enter_context(mp)

        yield start


@pytest.fixture(scope="module")
def policy(judged_policy, rules_judge):
    return judged_policy(rules_judge, "policy")


@pytest.fixture(scope="module")
def policy_broken_judge(judged_policy, broken_judge):
    return judged_policy(broken_judge, "policy-broken-judge")


def run_session(url: str, feedback: list[str]) -> tuple[str, list[dict]]:
    """One session: a turn per feedback message, each next request carries the reply + that feedback;
    the last request sends X-Session-Done, so its turn has no next state. Returns (session id, the
    request messages of every turn)."""
    sid = f"s-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": "You help with files."}, {"role": "user", "content": "Open the report."}]
    contexts = []
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        for i in range(len(feedback) + 1):
            last = i == len(feedback)
            headers = {"X-Session-Id": sid, **({"X-Session-Done": "true"} if last else {})}
            resp = client.post(
                "/v1/chat/completions",
                headers=headers,
                json={"model": "hindsight-policy", "messages": messages, "max_tokens": 6, "temperature": 1.0},
            )
            assert resp.status_code == 200, resp.text
            contexts.append([dict(m) for m in messages])
            if last:
                break
            msg = resp.json()["choices"][0]["message"]
            reply = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("tool_calls"):
                reply["tool_calls"] = msg["tool_calls"]
            messages = messages + [reply, {"role": "user", "content": feedback[i]}]
    return sid, contexts


def session_samples(data_dir: Path, sid: str, n: int, deadline_s: float = 60.0) -> list[dict]:
    """The session's n samples from the store (read-only), once none is pending_judge."""
    db = Path(data_dir) / "hindsight.sqlite3"

    def read_rows() -> list:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            return conn.execute(
                "SELECT turn_index, status, reject_reason, data FROM samples WHERE session_id=? ORDER BY turn_index",
                (sid,),
            ).fetchall()

    rows = wait_until(
        lambda: len(rows := read_rows()) == n and all(r[1] != "pending_judge" for r in rows) and rows,
        timeout_s=deadline_s,
        interval_s=0.2,
        message=lambda: f"session {sid} not judged: {read_rows()}",
    )
    return [
        {
            "turn_index": r[0],
            "status": r[1],
            "reject_reason": r[2],
            **({"data": json.loads(r[3])} if r[3] else {"data": None}),
        }
        for r in rows
    ]


def set_mode(url: str, **body) -> dict:
    resp = httpx.post(url + "/admin/mode", json=body, headers=ADMIN, trust_env=False)
    assert resp.status_code == 200, resp.text
    return resp.json()


def check_common(row: dict, mode: str) -> dict:
    d = row["data"]
    assert d["mode"] == mode and (d["w_rl"], d["w_opd"]) == (1.0, 0.5)
    n = len(d["response_ids"])
    assert n > 0 and len(d["rollout_logprobs"]) == n and len(d["loss_mask"]) == n
    assert d["loss_mask"] == ([1] * n if row["status"] == "ready" else [0] * n)
    assert d["token_rewards"] is None
    return d


def test_mode_endpoint_validates(policy):
    assert set_mode(policy.url) == {"mode": "rl", "w_rl": 1.0, "w_opd": 0.5}
    for bad in ({"mode": "sft"}, {"w_rl": -1.0}):
        resp = httpx.post(policy.url + "/admin/mode", json=bad, headers=ADMIN, trust_env=False)
        assert resp.status_code == 400, resp.text
    assert set_mode(policy.url) == {"mode": "rl", "w_rl": 1.0, "w_opd": 0.5}


def test_rl_mix_and_all_neutral_sessions(policy):
    set_mode(policy.url, mode="rl")
    mixed, _ = run_session(policy.url, [NEUTRAL, POSITIVE, NEGATIVE, NEUTRAL])
    neutral, _ = run_session(policy.url, [NEUTRAL, NEUTRAL])
    rows = session_samples(policy.extra["data_dir"], mixed, 5)
    # turn 0 neutral: first judged turn of a session without an included sample -> promoted, reward 0.0
    assert [(r["status"], r["reject_reason"]) for r in rows] == [
        ("ready", None),
        ("ready", None),
        ("ready", None),
        ("rejected", "prm_neutral"),
        ("rejected", "no_next_state"),
    ]
    assert [check_common(r, "rl")["reward"] for r in rows] == [0.0, 1.0, -1.0, None, None]
    assert [r["data"]["has_reward"] for r in rows] == [True, True, True, False, False]
    assert all(r["data"]["has_teacher"] is False and r["data"]["teacher_logprobs"] is None for r in rows)
    assert rows[3]["data"]["prm"]["score"] == 0 and rows[4]["data"]["prm"] is None

    rows = session_samples(policy.extra["data_dir"], neutral, 3)
    assert [(r["status"], r["reject_reason"]) for r in rows] == [
        ("ready", None),
        ("rejected", "prm_neutral"),
        ("rejected", "no_next_state"),
    ]
    assert [check_common(r, "rl")["reward"] for r in rows] == [0.0, None, None]


def test_opd_session_teacher_logprobs(policy, teacher_logprobs_torch, teacher_model_dir):
    set_mode(policy.url, mode="opd")
    try:
        sid, contexts = run_session(policy.url, [NEGATIVE, POSITIVE])
        rows = session_samples(policy.extra["data_dir"], sid, 3)
    finally:
        set_mode(policy.url, mode="rl")
    assert [(r["status"], r["reject_reason"]) for r in rows] == [
        ("ready", None),
        ("rejected", "no_hint"),
        ("rejected", "no_next_state"),
    ]
    d = check_common(rows[0], "opd")
    assert (d["has_teacher"], d["has_reward"], d["reward"]) == (True, False, None)
    assert d["hint"]["accepted"] is True and d["hint"]["hint"] == NEGATIVE
    assert d["prompt_versions"]["teacher_hint"].startswith("teacher_hint_v1@")
    assert d["prompt_versions"]["hint"].startswith("rules@")
    n = len(d["response_ids"])
    assert len(d["teacher_logprobs"]) == n and d["teacher_logprobs"][0] < 0  # first position real, not padding
    expected, top = teacher_logprobs_torch(contexts[0], None, d["response_ids"], NEGATIVE, TOP_K)
    n_positions = len(d["prompt_ids"]) + n + HINT_POSITIONS
    assert d["teacher_logprobs"] == pytest.approx(expected, abs=logprob_atol(teacher_model_dir, n_positions, expected))
    assert len(d["teacher_topk"]["ids"]) == n and len(d["teacher_topk"]["logprobs"]) == n
    tops = top.values.tolist()
    top_atol = logprob_atol(teacher_model_dir, n_positions, sum(tops, []))
    for got, want in zip(d["teacher_topk"]["logprobs"], tops, strict=True):
        assert got == pytest.approx(want, abs=top_atol)
    d1 = check_common(rows[1], "opd")
    assert d1["teacher_logprobs"] is None and d1["hint"]["accepted"] is False


def test_combine_session_and_lease(policy, teacher_logprobs_torch, teacher_model_dir):
    set_mode(policy.url, mode="combine")
    try:
        sid, contexts = run_session(policy.url, [NEGATIVE, POSITIVE, NEUTRAL])
        rows = session_samples(policy.extra["data_dir"], sid, 4)
    finally:
        set_mode(policy.url, mode="rl")
    assert [(r["status"], r["reject_reason"]) for r in rows] == [
        ("ready", None),
        ("ready", None),
        ("rejected", "no_signal: prm_neutral, no_hint"),
        ("rejected", "no_next_state"),
    ]
    both, rl_only = check_common(rows[0], "combine"), check_common(rows[1], "combine")
    assert (both["reward"], both["has_reward"], both["has_teacher"]) == (-1.0, True, True)
    expected, _ = teacher_logprobs_torch(contexts[0], None, both["response_ids"], NEGATIVE)
    n_positions = len(both["prompt_ids"]) + len(expected) + HINT_POSITIONS
    assert both["teacher_logprobs"] == pytest.approx(
        expected, abs=logprob_atol(teacher_model_dir, n_positions, expected)
    )
    assert (rl_only["reward"], rl_only["has_reward"], rl_only["has_teacher"]) == (1.0, True, False)
    assert rl_only["teacher_logprobs"] is None and rl_only["teacher_topk"] is None  # never teacher = rollout

    # Only ready samples are leased, with the Sample JSON of CONTRACTS.md.
    leased = {}
    while True:
        resp = httpx.get(policy.url + "/v1/samples/lease", params={"max": 64}, headers=ADMIN, trust_env=False)
        body = resp.json()
        if not body["samples"]:
            break
        leased.update({(s["session_id"], s["turn_index"]): s for s in body["samples"]})
        httpx.post(
            policy.url + "/v1/samples/ack", json={"lease_id": body["lease_id"]}, headers=ADMIN, trust_env=False
        ).raise_for_status()
    mine = {k[1]: v for k, v in leased.items() if k[0] == sid}
    assert sorted(mine) == [0, 1]
    assert mine[0]["teacher_logprobs"] == both["teacher_logprobs"] and mine[0]["mode"] == "combine"


def test_judge_failure_session_is_never_promoted(policy_broken_judge):
    sid, _ = run_session(policy_broken_judge.url, [NEUTRAL, POSITIVE])
    rows = session_samples(policy_broken_judge.extra["data_dir"], sid, 3)
    assert [r["status"] for r in rows] == ["rejected"] * 3
    assert [r["reject_reason"].split(":")[0] for r in rows] == ["judge_failed", "judge_failed", "no_next_state"]
    for r in rows[:2]:
        d = check_common(r, "rl")
        assert d["prm"]["status"] == "judge_failed" and d["reward"] is None and d["has_reward"] is False
