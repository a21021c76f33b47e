"""Explicit feedback end to end: client -> policy server (chat, then POST /v1/feedback) -> dispatcher -> judge
server (rules backend) -> store; samples leased through the admin API.

Contract (docs/REWARD_MODES.md "Explicit feedback"): for each ``--feedback-policy`` (override, average,
gate), feedback sent before the turn is judged (named by the chat response id) and after it (named by
session and turn index) changes the sample's reward as the policy says; feedback on a leased sample is
``late`` (stats, metric) and changes nothing; the same idempotency key counts once; unknown targets are
404, malformed bodies 400, a key reused on another turn 409; the admin view lists the feedback; in opd a
feedback's text is the hint the teacher is scored with (no hint extraction by the judge).
"""

from __future__ import annotations

import math
import uuid

import httpx
import pytest

from tests.modes.test_modes_e2e import session_samples
from tests.testkit.servers import ADMIN_KEY, start_judged_policy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
POSITIVE = "Thanks, that worked."
NEUTRAL = "Now list the folder."


@pytest.fixture(scope="module", params=["override", "average", "gate"])
def policy(request, tiny_model_dir, policy_engine, rules_judge, teacher_engine, modes_log_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp(f"feedback-{request.param}")
    mp = start_judged_policy(
        *(tiny_model_dir, policy_engine.url, rules_judge.url, data, modes_log_dir),
        name=f"policy-feedback-{request.param}",
        teacher_url=teacher_engine.url,
        extra=["--mode", "rl", "--feedback-policy", request.param, "--session-idle-timeout-s", "600"],
        client_key=None,
        fail_fast=False,
    )
    mp.extra["policy"] = request.param
    yield mp
    mp.stop()


def chat(client: httpx.Client, sid: str, messages: list[dict], done: bool = False) -> dict:
    headers = {"X-Session-Id": sid, **({"X-Session-Done": "true"} if done else {})}
    resp = client.post(
        "/v1/chat/completions", headers=headers, json={"model": "m", "messages": messages, "max_tokens": 6}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def two_turns(client: httpx.Client, reply: str, before=None) -> tuple[str, str]:
    """A session of two turns, the second its last; ``before(response_id)`` runs between them (the first
    turn is then still unjudged: its next state is not known). Returns (session id, first response id)."""
    sid = f"fb-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Open the report."}]
    first = chat(client, sid, messages)
    if before is not None:
        before(first["id"])
    answer = {"role": "assistant", "content": first["choices"][0]["message"].get("content") or ""}
    chat(client, sid, [*messages, answer, {"role": "user", "content": reply}], done=True)
    return sid, first["id"]


def feedback(client: httpx.Client, body: dict, status: int = 200, headers: dict | None = None) -> dict:
    resp = client.post("/v1/feedback", json=body, headers=headers or {})
    assert resp.status_code == status, resp.text
    return resp.json()


EXPECTED = {  # policy -> (turn 0: judge +1, feedback down before judging), (turn 1: no judge, feedback up after)
    "override": (("ready", None, -1.0), ("ready", None, 1.0)),
    "average": (("rejected", "feedback_neutral", None), ("ready", None, 1.0)),
    "gate": (
        ("rejected", "feedback_gate: judge +1, feedback -1", None),
        ("rejected", "feedback_gate: judge none, feedback +1", None),
    ),
}


def test_feedback_before_and_after_judging_per_policy(policy):
    name = policy.extra["policy"]
    with httpx.Client(base_url=policy.url, timeout=60, trust_env=False) as client:
        states = []
        sid, rid = two_turns(
            client,
            POSITIVE,
            before=lambda rid: states.append(feedback(client, {"response_id": rid, "value": "down"})),
        )
        assert rid.startswith("chatcmpl-") and states[0]["state"] == "pending"
        assert (states[0]["session_id"], states[0]["turn_index"], states[0]["policy"]) == (sid, 0, name)
        rows = session_samples(policy.extra["data_dir"], sid, 2)
        turn0, turn1 = EXPECTED[name]
        assert (rows[0]["status"], rows[0]["reject_reason"], rows[0]["data"]["reward"]) == turn0
        assert rows[0]["data"]["prm"]["score"] == 1  # the judge's verdict is kept for audit
        assert rows[0]["data"]["feedback"] == {
            "value": -1.0,
            "text": None,
            "policy": name,
            "judge_reward": 1.0,
            "count": 1,
        }
        assert (rows[1]["status"], rows[1]["reject_reason"]) == ("rejected", "no_next_state")
        after = feedback(client, {"session_id": sid, "turn_index": 1, "value": "up"})
        assert after["state"] == "applied" and after["sample_status"] == turn1[0]
        [row] = client.get("/v1/samples", params={"session_id": sid}, headers=ADMIN).json()["samples"][1:]
        assert (row["status"], row["reject_reason"], row["sample"]["reward"]) == turn1
        if turn1[0] == "ready":
            assert row["sample"]["loss_mask"] == [1] * len(row["sample"]["response_ids"])


def test_duplicates_late_feedback_and_admin_view(policy):
    with httpx.Client(base_url=policy.url, timeout=60, trust_env=False) as client:
        sid, rid = two_turns(client, POSITIVE)
        [first, _] = session_samples(policy.extra["data_dir"], sid, 2)
        assert (first["status"], first["data"]["reward"]) == ("ready", 1.0)
        body = {"response_id": rid, "value": 1, "text": "exactly right", "idempotency_key": f"k-{sid}"}
        one = feedback(client, body)
        two = feedback(client, {**body, "idempotency_key": None}, headers={"Idempotency-Key": f"k-{sid}"})
        assert one["state"] == "applied" and not one["duplicate"]
        assert two == {**one, "duplicate": True}
        rows = client.get("/v1/samples", params={"session_id": sid}, headers=ADMIN).json()["samples"]
        assert rows[0]["sample"]["reward"] == 1.0 and rows[0]["sample"]["feedback"]["count"] == 1
        # leased: feedback now is late, counted, and the leased sample is not changed
        leased = client.get("/v1/samples/lease", params={"max": 4096}, headers=ADMIN).json()
        assert sid in {s["session_id"] for s in leased["samples"]}
        late = feedback(client, {"response_id": rid, "value": "down"})
        assert (late["state"], late["sample_status"]) == ("late", "leased")
        rows = client.get("/v1/samples", params={"session_id": sid}, headers=ADMIN).json()["samples"]
        assert rows[0]["sample"]["reward"] == 1.0
        stats = client.get("/v1/samples/stats", headers=ADMIN).json()["feedback"]
        assert stats["late"] >= 1 and stats["policy"] == policy.extra["policy"]
        metrics = client.get("/metrics").text
        assert 'hindsight_policy_feedback_total{state="late"}' in metrics
        view = client.get("/admin/feedback", params={"session_id": sid}, headers=ADMIN).json()
        assert [(r["state"], r["value"]) for r in view["feedback"]] == [("late", -1.0), ("applied", 1.0)]
        assert view["feedback"][1]["text"] == "exactly right" and view["stats"]["total"] >= 2
        assert client.get("/admin/feedback").status_code == 401


def test_feedback_refusals(policy):
    with httpx.Client(base_url=policy.url, timeout=60, trust_env=False) as client:
        sid, rid = two_turns(client, NEUTRAL)
        assert feedback(client, {"response_id": "chatcmpl-unknown", "value": "up"}, 404)["error"]["message"]
        feedback(client, {"session_id": sid, "turn_index": 7, "value": "up"}, 404)
        feedback(client, {"session_id": "no-such-session", "turn_index": 0, "value": "up"}, 404)
        for bad in (
            {"response_id": rid, "value": 2},
            {"response_id": rid, "value": "meh"},
            {"response_id": rid, "value": True},
            {"response_id": rid},
            {"value": "up"},
            {"response_id": rid, "session_id": sid, "turn_index": 0, "value": "up"},
            {"session_id": sid, "value": "up"},
            {"response_id": rid, "value": "up", "rating": 5},
            {"session_id": sid, "turn_index": -1, "value": "up"},
        ):
            err = feedback(client, bad, 400)["error"]
            assert err["type"] == "invalid_request_error" and err["message"], bad
        feedback(client, {"response_id": rid, "value": "up", "idempotency_key": f"x-{sid}"})
        conflict = feedback(
            client, {"session_id": sid, "turn_index": 1, "value": "up", "idempotency_key": f"x-{sid}"}, 409
        )
        assert "idempotency_key" in conflict["error"]["message"]


@pytest.mark.parametrize("policy", ["override"], indirect=True)  # the hint source does not depend on the policy
def test_feedback_text_is_the_opd_hint(policy):
    headers = ADMIN
    resp = httpx.post(policy.url + "/admin/mode", json={"mode": "opd"}, headers=headers, trust_env=False)
    assert resp.status_code == 200, resp.text
    try:
        with httpx.Client(base_url=policy.url, timeout=60, trust_env=False) as client:
            hint = "Give the file name before opening it."
            sid, _ = two_turns(
                client,
                NEUTRAL,  # the rules judge extracts no hint from a neutral reply: only the feedback can give one
                before=lambda rid: feedback(client, {"response_id": rid, "value": "down", "text": hint}),
            )
            rows = session_samples(policy.extra["data_dir"], sid, 2)
            d = rows[0]["data"]
            assert rows[0]["status"] == "ready" and d["has_teacher"] and d["reward"] is None
            assert (d["hint"]["hint"], d["hint"]["source"], d["hint"]["engine_calls"]) == (hint, "feedback", 0)
            assert len(d["teacher_logprobs"]) == len(d["response_ids"]) and d["prompt_versions"]["hint"] == "feedback"
            assert rows[1]["reject_reason"] == "no_next_state"  # no feedback there: nothing to judge
    finally:
        httpx.post(policy.url + "/admin/mode", json={"mode": "rl"}, headers=headers, trust_env=False)


def test_feedback_names_responses_and_messages_turns_by_their_own_ids(policy):
    """A Responses turn is named by its ``resp_`` id and an Anthropic Messages turn by its ``msg_`` id: the
    turn records the id its client got, whatever the API shape."""
    sid = f"fb-shapes-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=policy.url, timeout=60, trust_env=False) as client:
        headers = {"X-Session-Id": sid}
        first = client.post(
            "/v1/responses", headers=headers, json={"model": "m", "input": "Open the report.", "max_output_tokens": 6}
        )
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        text = "".join(
            c.get("text", "") for item in first.json()["output"] if item["type"] == "message" for c in item["content"]
        )
        second = client.post(
            "/v1/messages",
            headers=headers,
            json={
                "model": "m",
                "max_tokens": 6,
                "messages": [
                    {"role": "user", "content": "Open the report."},
                    {"role": "assistant", "content": text or "ok"},
                    {"role": "user", "content": NEUTRAL},
                ],
            },
        )
        assert second.status_code == 200, second.text
        mid = second.json()["id"]
        assert rid.startswith("resp_") and mid.startswith("msg_")
        one = feedback(client, {"response_id": rid, "value": "up"})
        two = feedback(client, {"response_id": mid, "value": "down"})
        assert {one["state"], two["state"]} <= {"pending", "applied"}
        view = client.get("/admin/feedback", params={"session_id": sid}, headers=ADMIN).json()["feedback"]
        assert sorted((r["turn_index"], r["value"]) for r in view) == [(0, 1.0), (1, -1.0)]


# ---------------------------------------------------------------------------- combine: late feedback, agreement
@pytest.fixture(scope="module")
def combine_policy(tiny_model_dir, policy_engine, rules_judge, teacher_engine, modes_log_dir, tmp_path_factory):
    """A policy server of its own (its store holds only this test's feedback): combine, --feedback-policy average."""
    data = tmp_path_factory.mktemp("feedback-combine")
    extra = ["--mode", "combine", "--w-opd", "0.5", "--feedback-policy", "average", "--session-idle-timeout-s", "600"]
    with start_judged_policy(
        *(tiny_model_dir, policy_engine.url, rules_judge.url, data, modes_log_dir),
        name="policy-feedback-combine",
        teacher_url=teacher_engine.url,
        extra=extra,
        client_key=None,
        fail_fast=False,
    ) as mp:
        yield mp


def session_of(client: httpx.Client, replies: list[str]) -> str:
    """A session with a turn per reply plus a last turn (no next state); returns its id once it is judged."""
    sid = f"fbc-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Open the report."}]
    for reply in [*replies, None]:
        answer = chat(client, sid, messages, done=reply is None)["choices"][0]["message"].get("content") or ""
        if reply is not None:
            messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": reply}]
    return sid


def agreement_metrics(client: httpx.Client) -> dict[str, float]:
    """The judge/feedback agreement series of /metrics, by sample line name (labels included)."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("hindsight_policy_judge_feedback_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_combine_late_feedback_agreement_and_at_least_one(combine_policy, tmp_path):
    """combine + average: feedback after judging re-decides w_rl's reward and keeps the teacher term; the
    agreement gauges follow the pairs; a late "down" on a session's only included sample (a +1 without hint)
    excludes it and the at-least-one rule includes the session's neutral turn with reward 0.0."""
    from tests.modes.test_modes_e2e import NEGATIVE
    from tests.waiting import wait_until
    from trainer.report.data import agreement_series, collect

    data_dir = combine_policy.extra["data_dir"]
    with httpx.Client(base_url=combine_policy.url, timeout=60, trust_env=False) as client:
        before = agreement_metrics(client)
        assert before["hindsight_policy_judge_feedback_pairs"] == 0
        assert math.isnan(before["hindsight_policy_judge_feedback_agreement"])  # no pair: NaN, never 0

        one = session_of(client, [NEGATIVE, POSITIVE])  # turn 0: -1 + correction hint, turn 1: +1
        rows = session_samples(data_dir, one, 3)
        assert [(r["status"], r["data"]["reward"], r["data"]["has_teacher"]) for r in rows[:2]] == [
            ("ready", -1.0, True),
            ("ready", 1.0, False),
        ]
        assert feedback(client, {"session_id": one, "turn_index": 0, "value": 0.5})["state"] == "applied"
        assert feedback(client, {"session_id": one, "turn_index": 1, "value": "up"})["state"] == "applied"

        two = session_of(client, [POSITIVE, NEUTRAL])  # turn 0: +1 (its only included), turn 1: neutral
        rows = session_samples(data_dir, two, 3)
        assert [(r["status"], r["reject_reason"]) for r in rows[:2]] == [
            ("ready", None),
            ("rejected", "no_signal: prm_neutral, no_hint"),
        ]
        late = feedback(client, {"session_id": two, "turn_index": 0, "value": "down"})
        assert (late["state"], late["sample_status"]) == ("applied", "rejected")  # (+1 - 1) / 2 = 0

        leased = {}
        while body := client.get("/v1/samples/lease", params={"max": 64}, headers=ADMIN).json():
            if not body["samples"]:
                break
            leased.update({(s["session_id"], s["turn_index"]): s for s in body["samples"]})
            client.post("/v1/samples/ack", json={"lease_id": body["lease_id"]}, headers=ADMIN).raise_for_status()
        assert {k for k in leased if k[0] in (one, two)} == {(one, 0), (one, 1), (two, 1)}
        taught = leased[(one, 0)]  # reward (-1 + 0.5) / 2 for w_rl, the teacher term for w_opd, both kept
        n = len(taught["response_ids"])
        assert (taught["mode"], taught["reward"], taught["has_reward"], taught["has_teacher"]) == (
            "combine",
            -0.25,
            True,
            True,
        )
        assert (taught["w_rl"], taught["w_opd"]) == (1.0, 0.5) and len(taught["teacher_logprobs"]) == n
        assert taught["loss_mask"] == [1] * n and taught["feedback"]["judge_reward"] == -1.0
        assert leased[(one, 1)]["reward"] == 1.0 and not leased[(one, 1)]["has_teacher"]
        promoted = leased[(two, 1)]  # at-least-one after the late feedback: the neutral turn, reward 0.0
        assert (promoted["reward"], promoted["has_reward"], promoted["has_teacher"]) == (0.0, True, False)
        assert promoted["loss_mask"] == [1] * len(promoted["response_ids"]) and promoted["prm"]["score"] == 0

        # pairs: (-1, +0.5) disagree, (+1, up) agree, (+1, down) disagree
        after = wait_until(
            lambda: (m := agreement_metrics(client))["hindsight_policy_judge_feedback_pairs"] == 3 and m,
            timeout_s=30,
            interval_s=1.0,
            message=lambda: f"agreement not refreshed: {agreement_metrics(client)}",
        )
        assert after["hindsight_policy_judge_feedback_agreement"] == pytest.approx(1 / 3)
        counter = 'hindsight_policy_judge_feedback_outcomes_total{{feedback="{}",outcome="{}",verdict="{}"}}'
        assert after[counter.format("+1", "disagree", "-1")] == 1
        assert after[counter.format("+1", "agree", "+1")] == 1
        assert after[counter.format("-1", "disagree", "+1")] == 1
        assert after[counter.format("0", "agree", "0")] == 0
    # the run report reads the same pairs through the admin API and ends on the gauge's value
    report = collect(tmp_path, policy_url=combine_policy.url, admin_api_key=ADMIN_KEY)
    assert agreement_series(report.feedback)[-1][1] == pytest.approx(1 / 3)
