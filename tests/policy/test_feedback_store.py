"""Explicit feedback: the pure policy rules and their application in the store (both backends).

Contract (policy_server.rewards.feedback, policy_server.store.feedback_rule, policy_server.store.feedback):
override / average / gate combine a feedback value with the judge's stored PRM verdict; feedback on a turn not judged yet stays ``pending``;
on a ready or reward-rejected sample it applies at once (a rejected one may become ready); on a leased one
it is ``late`` and changes nothing; the same idempotency key twice is one feedback; the key reused on
another turn is a conflict; the response id recorded with the turn finds it.
"""

from __future__ import annotations

import math

import pytest

from engine.records import RejectReason as R
from engine.records import Sample, TurnRecord
from policy_server.rewards.feedback import InvalidFeedback, feedback_value
from policy_server.store import FeedbackConflict, Resolution
from policy_server.store.feedback_rule import apply_feedback, combined_reward, judge_reward
from policy_server.store.records import FeedbackCounts, SampleRow, TurnFeedback

pytestmark = pytest.mark.unit

U = {"role": "user", "content": "what is 17*3?"}


def _record(response_id: str, n: int = 3) -> dict:
    return {
        "messages": [U],
        "prompt_ids": [1, 2],
        "response_ids": list(range(n)),
        "rollout_logprobs": [-0.5] * n,
        "response": {"content": "51"},
        "response_id": response_id,
    }


def _prm(score: int | None, status: str = "ok") -> dict:
    return {"score": score, "status": status, "votes": [score] * 3, "confidence": 1.0, "reason": None}


def _sample(mode: str, prm: dict | None, reward: float | None) -> dict:
    return {
        "mode": mode,
        "loss_mask": [1 if reward is not None else 0] * 3,
        "reward": reward,
        "has_reward": reward is not None,
        "has_teacher": False,
        "prm": prm,
        "response_ids": [0, 1, 2],
    }


# ---------------------------------------------------------------------------- pure rules
@pytest.mark.parametrize(("raw", "value"), [("up", 1.0), ("DOWN", -1.0), (0.5, 0.5), (-1, -1.0), (0, 0.0), (1.0, 1.0)])
def test_feedback_value_accepts_words_and_numbers_in_range(raw, value):
    assert feedback_value(raw) == value


@pytest.mark.parametrize("raw", ["meh", 1.5, -2, math.nan, math.inf, True, None, [1], {"v": 1}])
def test_feedback_value_refuses_anything_else(raw):
    with pytest.raises(InvalidFeedback):
        feedback_value(raw)


def test_judge_reward_reads_the_stored_verdict():
    assert judge_reward(_prm(1)) == 1.0 and judge_reward(_prm(-1)) == -1.0 and judge_reward(_prm(0)) == 0.0
    assert judge_reward(_prm(None, "tie")) == 0.0
    assert judge_reward(_prm(None, "no_valid_votes")) is None
    assert judge_reward(_prm(None, "judge_failed")) is None and judge_reward(None) is None


@pytest.mark.parametrize(
    ("policy", "judge", "value", "reward", "reason"),
    [
        ("override", 1.0, -1.0, -1.0, None),
        ("override", None, 0.5, 0.5, None),
        ("override", 1.0, 0.0, None, R.FEEDBACK_NEUTRAL),
        ("average", 1.0, -0.5, 0.25, None),
        ("average", -1.0, 1.0, None, R.FEEDBACK_NEUTRAL),
        ("average", None, -1.0, -1.0, None),
        ("average", 0.0, 1.0, 0.5, None),
        ("gate", 1.0, 0.3, 1.0, None),
        ("gate", -1.0, -1.0, -1.0, None),
        ("gate", 1.0, -1.0, None, "feedback_gate: judge +1, feedback -1"),
        ("gate", None, 1.0, None, "feedback_gate: judge none, feedback +1"),
        ("gate", 0.0, 1.0, None, "feedback_gate: judge +0, feedback +1"),
    ],
)
def test_combined_reward_per_policy(policy, judge, value, reward, reason):
    assert combined_reward(policy, judge, value) == (reward, reason)


def test_apply_feedback_can_include_a_neutral_turn_and_exclude_a_rewarded_one():
    status, why, out = apply_feedback(
        "rejected", R.PRM_NEUTRAL, _sample("rl", _prm(0), None), value=1.0, text="good", policy="override"
    )
    assert (status, why, out["reward"], out["has_reward"], out["loss_mask"]) == ("ready", None, 1.0, True, [1, 1, 1])
    assert out["feedback"] == {"value": 1.0, "text": "good", "policy": "override", "judge_reward": 0.0, "count": 1}
    status, why, out = apply_feedback("ready", None, _sample("rl", _prm(1), 1.0), value=-1.0, text=None, policy="gate")
    assert (status, out["reward"], out["has_reward"], out["loss_mask"]) == ("rejected", None, False, [0, 0, 0])
    assert why == "feedback_gate: judge +1, feedback -1"
    # opd has no reward term: the feedback is recorded, the sample unchanged
    status, why, out = apply_feedback(
        "ready", None, _sample("opd", None, None), value=-1.0, text="x", policy="override"
    )
    assert (status, why, out["reward"]) == ("ready", None, None) and out["feedback"]["value"] == -1.0


# ---------------------------------------------------------------------------- store
def _complete(store, sample_id: str, status: str, reason: str | None, sample: dict) -> None:
    """Write a judge outcome as the dispatcher does: ``status`` with its reject reason and Sample JSON."""
    store.complete_judge(
        sample_id, status=status, reject_reason=reason, included=status == "ready", data=Sample.model_validate(sample)
    )


def _judged(store, sid: str, rid: str, *, status: str, reason: str | None, sample: dict) -> str:
    store.record_turn(sid, TurnRecord.model_validate(_record(rid)), session_done=True)
    [job] = [j for j in store.pending_jobs() if j.session_id == sid]
    _complete(store, job.sample_id, status, reason, sample)
    return job.sample_id


def _row(store, sid: str) -> SampleRow:
    [row] = store.list_samples(session_id=sid, limit=10)
    return row


def test_feedback_before_judging_stays_pending_then_settles(store_factory):
    st = store_factory()
    st.record_turn("s1", TurnRecord.model_validate(_record("chatcmpl-a")), session_done=False)
    assert st.turn_by_response_id("chatcmpl-a") == ("s1", 0)
    out = st.add_feedback("s1", 0, value=-1.0, text="use 51", idempotency_key=None, policy="override")
    assert (out.state, out.sample_status, out.duplicate) == ("pending", None, False)
    assert st.turn_feedback("s1", 0) == TurnFeedback(value=-1.0, text="use 51", count=1)
    st.resolve_turn("s1", Resolution(0, "paired", [{"role": "user", "content": "thanks"}]))
    [job] = st.pending_jobs()
    st.complete_judge(
        job.sample_id,
        status="ready",
        reject_reason=None,
        included=True,
        data=Sample.model_validate(_sample("rl", _prm(1), 1.0)),
    )
    assert st.settle_feedback("s1", 0, "override") == "applied"
    row = _row(st, "s1")
    assert row.sample["reward"] == -1.0 and row.status == "ready"
    assert st.settle_feedback("s1", 0, "override") is None  # nothing pending any more
    assert st.feedback_stats().applied == 1


@pytest.mark.parametrize(
    ("policy", "status", "reward"),
    [("override", "ready", -1.0), ("average", "ready", -0.5), ("gate", "rejected", None)],
)
def test_feedback_after_judging_applies_per_policy(store_factory, policy, status, reward):
    st = store_factory()
    _judged(st, "s2", "chatcmpl-b", status="rejected", reason=R.PRM_NEUTRAL, sample=_sample("rl", _prm(0), None))
    out = st.add_feedback("s2", 0, value=-1.0, text=None, idempotency_key=None, policy=policy)
    assert out.state == "applied" and out.sample_status == status
    row = _row(st, "s2")
    assert row.status == status and row.sample["reward"] == reward
    if status == "rejected":
        assert row.reject_reason == "feedback_gate: judge +0, feedback -1"
    else:
        assert st.lease(10, 60.0)[1][0].reward == reward  # now leasable, with the feedback's reward


def test_feedback_after_leasing_is_late_and_changes_nothing(store_factory):
    st = store_factory()
    _judged(st, "s3", "chatcmpl-c", status="ready", reason=None, sample=_sample("rl", _prm(1), 1.0))
    lease_id, [leased] = st.lease(10, 60.0)
    out = st.add_feedback("s3", 0, value=-1.0, text=None, idempotency_key=None, policy="override")
    assert (out.state, out.sample_status) == ("late", "leased")
    assert _row(st, "s3").sample["reward"] == 1.0
    assert st.feedback_stats() == FeedbackCounts(pending=0, applied=0, late=1, recorded=0, total=1)


def test_same_idempotency_key_counts_once_and_conflicts_elsewhere(store_factory):
    st = store_factory()
    _judged(st, "s4", "chatcmpl-d", status="ready", reason=None, sample=_sample("rl", _prm(1), 1.0))
    first = st.add_feedback("s4", 0, value=0.5, text=None, idempotency_key="k1", policy="average")
    again = st.add_feedback("s4", 0, value=0.5, text=None, idempotency_key="k1", policy="average")
    assert again == first.model_copy(update={"duplicate": True})
    assert st.turn_feedback("s4", 0).count == 1 and _row(st, "s4").sample["reward"] == 0.75
    st.record_turn("s5", TurnRecord.model_validate(_record("chatcmpl-e")), session_done=True)
    with pytest.raises(FeedbackConflict):
        st.add_feedback("s5", 0, value=1.0, text=None, idempotency_key="k1", policy="average")
    # a second, distinct feedback replaces the value (the latest counts) and is re-applied from the verdict
    st.add_feedback("s4", 0, value=-1.0, text=None, idempotency_key="k2", policy="average")
    row = _row(st, "s4")
    assert (row.status, row.reject_reason, row.sample["reward"]) == ("rejected", R.FEEDBACK_NEUTRAL, None)
    assert row.sample["feedback"]["count"] == 2


def test_unknown_turn_and_defective_turn(store_factory):
    st = store_factory()
    assert st.add_feedback("nope", 0, value=1.0, text=None, idempotency_key=None, policy="override") is None
    assert st.turn_by_response_id("chatcmpl-none") is None
    _judged(st, "s6", "chatcmpl-f", status="rejected", reason=R.HISTORY_MISMATCH, sample=_sample("rl", None, None))
    out = st.add_feedback("s6", 0, value=1.0, text=None, idempotency_key=None, policy="override")
    assert out.state == "recorded" and _row(st, "s6").status == "rejected"
    assert [r.state for r in st.list_feedback("s6")] == ["recorded"]
