"""Late explicit feedback and the at-least-one rule, and the judge/feedback agreement read (both backends).

Contract (policy_server.store.feedback, policy_server.store.feedback_rule): feedback that excludes a session's
last included sample re-runs the rule in its own transaction: the session's earliest turn with a neutral PRM
verdict (``prm_neutral``, ``prm_tie``, ``no_signal`` over a neutral verdict; rl or combine) becomes ``ready``
with reward 0.0; ``no_valid_votes``, defects, ``degenerate: ...`` and ``feedback_*`` turns never do; a leased
or consumed sample counts as included and is never changed; without a candidate the session's flag is cleared
for the dispatcher; feedback that includes a turn keeps an earlier promoted one. ``judge_agreement`` pairs the
latest feedback of each judged turn with its verdict sign, over the latest N such turns, and counts every
settled feedback in its totals.
"""

from __future__ import annotations

import pytest

from engine.records import RejectReason as R
from engine.records import Sample, TurnRecord
from policy_server.store import Resolution
from policy_server.store.feedback_rule import judge_sign, promotable, promote, value_sign
from policy_server.store.records import FeedbackAnswer
from tests.policy.test_feedback_store import _complete, _prm, _record, _sample

pytestmark = pytest.mark.unit

NEXT = [{"role": "user", "content": "go on"}]


def _session(store, sid: str, outcomes: list[tuple[str, str | None, dict]]) -> list[str]:
    """A finished session whose turn i was judged ``outcomes[i]`` = (status, reject reason, Sample JSON), in
    turn order (as the dispatcher writes them); returns the sample ids."""
    for i in range(len(outcomes)):
        if i:
            store.resolve_turn(sid, Resolution(i - 1, "paired", NEXT))
        store.record_turn(
            sid, TurnRecord.model_validate(_record(f"chatcmpl-{sid}-{i}")), session_done=i == len(outcomes) - 1
        )
    jobs = sorted((j for j in store.pending_jobs() if j.session_id == sid), key=lambda j: j.turn_index)
    assert len(jobs) == len(outcomes)
    for job, (status, reason, sample) in zip(jobs, outcomes, strict=True):
        _complete(store, job.sample_id, status, reason, sample)
    return [j.sample_id for j in jobs]


def _rows(store, sid: str) -> list[tuple[str, str | None, float | None]]:
    rows = sorted(store.list_samples(session_id=sid, limit=50), key=lambda r: r.turn_index)
    return [(r.status, r.reject_reason, (r.sample or {})["reward"]) for r in rows]


def _down(store, sid: str, turn: int, policy: str = "gate", **kw) -> FeedbackAnswer:
    return store.add_feedback(sid, turn, value=-1.0, text=None, idempotency_key=None, policy=policy, **kw)


POS = ("ready", None, _sample("rl", _prm(1), 1.0))
NEUTRAL = ("rejected", R.PRM_NEUTRAL, _sample("rl", _prm(0), None))
TIE = ("rejected", R.PRM_TIE, _sample("rl", _prm(None, "tie"), None))
NO_VALID = ("rejected", R.PRM_NO_VALID_VOTES, _sample("rl", _prm(None, "no_valid_votes"), None))
DEGENERATE = ("rejected", "degenerate: repeated 40 times", _sample("rl", _prm(0), None))


# ---------------------------------------------------------------------------- pure rules
def test_signs_of_verdicts_and_values():
    assert [value_sign(v) for v in (1.0, 0.25, 0.0, -0.5)] == [1, 1, 0, -1]
    assert [judge_sign(_prm(s)) for s in (1, 0, -1)] == [1, 0, -1] and judge_sign(_prm(None, "tie")) == 0
    assert judge_sign(_prm(None, "no_valid_votes")) is None and judge_sign(None) is None


@pytest.mark.parametrize(
    ("reason", "sample", "ok"),
    [
        (R.PRM_NEUTRAL, _sample("rl", _prm(0), None), True),
        (R.PRM_TIE, _sample("combine", _prm(None, "tie"), None), True),
        ("no_signal: prm_neutral, no_hint", _sample("combine", _prm(0), None), True),
        ("no_signal: prm_no_valid_votes, no_hint", _sample("combine", _prm(None, "no_valid_votes"), None), False),
        (R.PRM_NO_VALID_VOTES, _sample("rl", _prm(None, "no_valid_votes"), None), False),
        (R.FEEDBACK_NEUTRAL, _sample("rl", _prm(0), None), False),
        ("degenerate: repeated 40 times", _sample("rl", _prm(0), None), False),
        (R.EMPTY_RESPONSE, _sample("rl", _prm(0), None), False),
        (R.PRM_NEUTRAL, _sample("opd", _prm(0), None), False),
        (None, _sample("rl", _prm(0), None), False),
    ],
)
def test_promotable_is_the_judging_rule_case_only(reason, sample, ok):
    assert promotable(reason, sample) is ok


def test_promote_includes_every_token_with_reward_zero():
    out = promote(_sample("rl", _prm(0), None))
    assert (out["reward"], out["has_reward"], out["loss_mask"]) == (0.0, True, [1, 1, 1])


# ---------------------------------------------------------------------------- at-least-one after feedback
def test_feedback_excluding_the_last_included_sample_promotes_the_earliest_neutral_turn(store_factory):
    st = store_factory()
    _session(st, "a", [NO_VALID, POS, DEGENERATE, TIE, NEUTRAL])
    out = _down(st, "a", 1)
    assert (out.state, out.sample_status) == ("applied", "rejected")
    assert (
        _rows(st, "a")
        == [
            NO_VALID[:2] + (None,),
            ("rejected", "feedback_gate: judge +1, feedback -1", None),
            DEGENERATE[:2] + (None,),
            ("ready", None, 0.0),  # turn 3 (tie) is the earliest promotable turn
            NEUTRAL[:2] + (None,),
        ]
    )
    assert st.session("a").has_included == 1
    _, leased = st.lease(10, 60.0)
    assert [(s.reward, s.loss_mask) for s in leased] == [(0.0, [1, 1, 1])]  # turn 3's, the only ready one


def test_without_a_promotable_turn_the_flag_is_cleared_for_the_dispatcher(store_factory):
    st = store_factory()
    _session(st, "b", [NO_VALID, POS, DEGENERATE])
    assert st.session("b").has_included == 1
    _down(st, "b", 1)
    assert [r[0] for r in _rows(st, "b")] == ["rejected"] * 3
    assert st.session("b").has_included == 0  # the next neutral turn judged is promoted


def test_rule_off_promotes_nothing(store_factory):
    st = store_factory()
    _session(st, "c", [POS, NEUTRAL])
    _down(st, "c", 0, at_least_one=False)
    assert [r[0] for r in _rows(st, "c")] == ["rejected", "rejected"] and st.session("c").has_included == 0


def test_leased_sample_counts_as_included_and_is_never_changed(store_factory):
    st = store_factory()
    _session(st, "d", [POS, NEUTRAL, POS])
    lease_id, _ = st.lease(1, 60.0)
    leased = next(i for i, r in enumerate(_rows(st, "d")) if r[0] == "leased")
    other = 2 - leased  # the other +1 turn (0 or 2)
    assert _down(st, "d", leased).state == "late"
    _down(st, "d", other)
    rows = _rows(st, "d")
    assert rows[leased] == ("leased", None, 1.0) and rows[1] == NEUTRAL[:2] + (None,)
    assert rows[other] == ("rejected", "feedback_gate: judge +1, feedback -1", None)
    st.ack(lease_id)
    assert _rows(st, "d")[leased][0] == "consumed" and st.session("d").has_included == 1


def test_other_included_sample_left_means_no_promotion(store_factory):
    st = store_factory()
    _session(st, "e", [POS, NEUTRAL, POS])
    _down(st, "e", 2, policy="average")  # +1 and -1 average to 0: feedback_neutral, turn 0 still included
    assert _rows(st, "e") == [("ready", None, 1.0), NEUTRAL[:2] + (None,), ("rejected", R.FEEDBACK_NEUTRAL, None)]


def test_promoted_turn_stays_when_feedback_includes_another(store_factory):
    st = store_factory()
    promoted = ("ready", None, _sample("rl", _prm(0), 0.0))
    _session(st, "f", [promoted, NEUTRAL])
    st.add_feedback("f", 1, value=1.0, text=None, idempotency_key=None, policy="override")
    assert _rows(st, "f") == [("ready", None, 0.0), ("ready", None, 1.0)]


def test_combine_no_signal_over_a_neutral_verdict_is_promoted(store_factory):
    st = store_factory()
    combine_pos = ("ready", None, _sample("combine", _prm(1), 1.0))
    no_valid = (
        "rejected",
        "no_signal: prm_no_valid_votes, no_hint",
        _sample("combine", _prm(None, "no_valid_votes"), None),
    )
    neutral = ("rejected", "no_signal: prm_neutral, no_hint", _sample("combine", _prm(0), None))
    _session(st, "g", [combine_pos, no_valid, neutral])
    _down(st, "g", 0)
    assert [r[0] for r in _rows(st, "g")] == ["rejected", "rejected", "ready"]
    assert _rows(st, "g")[2][2] == 0.0


def test_feedback_settled_after_judging_reruns_the_rule(store_factory):
    """Feedback sent while the judge ran is settled by the dispatcher right after the outcome is written."""
    st = store_factory()
    st.record_turn("h", TurnRecord.model_validate(_record("chatcmpl-h0")), session_done=False)
    st.resolve_turn("h", Resolution(0, "paired", NEXT))
    st.record_turn("h", TurnRecord.model_validate(_record("chatcmpl-h1")), session_done=True)
    jobs = sorted((j for j in st.pending_jobs() if j.session_id == "h"), key=lambda j: j.turn_index)
    st.complete_judge(
        jobs[0].sample_id, status="ready", reject_reason=None, included=True, data=Sample.model_validate(POS[2])
    )
    assert _down(st, "h", 1).state == "pending"  # turn 1 not judged yet
    st.complete_judge(
        jobs[1].sample_id,
        status="rejected",
        reject_reason=R.PRM_NEUTRAL,
        included=False,
        data=Sample.model_validate(NEUTRAL[2]),
    )
    assert st.settle_feedback("h", 1, "gate") == "applied"  # gate on a neutral verdict: still rejected
    assert _down(st, "h", 0).state == "applied"
    # turn 1's reason is now feedback_gate (decided by its feedback): nothing left to promote
    assert [r[:2] for r in _rows(st, "h")] == [
        ("rejected", "feedback_gate: judge +1, feedback -1"),
        ("rejected", "feedback_gate: judge +0, feedback -1"),
    ]
    assert st.session("h").has_included == 0


# ---------------------------------------------------------------------------- agreement
def _judged_turn(store, sid: str, prm: dict | None, mode: str = "rl") -> None:
    status = "ready" if prm is not None and prm.get("score") in (1, -1) else "rejected"
    reason = None if status == "ready" else R.PRM_NEUTRAL
    _session(store, sid, [(status, reason, _sample(mode, prm, 1.0 if status == "ready" else None))])


def _fb(store, sid: str, value: float, now: float) -> None:
    store.add_feedback(sid, 0, value=value, text=None, idempotency_key=None, policy="override", now=now)


def test_agreement_pairs_the_latest_feedback_of_each_judged_turn(store_factory):
    st = store_factory()
    assert st.judge_agreement(10).window.share is None and st.judge_agreement(10).total.pairs == 0
    _judged_turn(st, "p1", _prm(1))
    _judged_turn(st, "p2", _prm(-1))
    _judged_turn(st, "p3", _prm(0))
    _judged_turn(st, "p4", _prm(None, "no_valid_votes"))  # no verdict: no pair
    _judged_turn(st, "p5", None, mode="opd")  # no PRM verdict at all: no pair
    st.record_turn(
        "p6", TurnRecord.model_validate(_record("chatcmpl-p6")), session_done=False
    )  # not judged: pending, no pair yet
    _fb(st, "p1", 1.0, now=100.0)  # agree
    _fb(st, "p2", 1.0, now=101.0)  # disagree
    _fb(st, "p3", 0.0, now=102.0)  # neutral against neutral: agree
    _fb(st, "p4", 1.0, now=103.0)
    _fb(st, "p5", -1.0, now=104.0)
    st.add_feedback("p6", 0, value=1.0, text=None, idempotency_key=None, policy="override", now=105.0)
    agreement = st.judge_agreement(10)
    assert (agreement.window.pairs, agreement.window.agree) == (3, 2)
    assert agreement.window.share == pytest.approx(2 / 3)
    cells = {(v, f): n for v, f, n in agreement.window.cells}
    assert len(cells) == 9 and cells[(1, 1)] == cells[(-1, 1)] == cells[(0, 0)] == 1
    # a changed mind: the turn counts once in the window with its latest value, twice in the totals
    _fb(st, "p2", -1.0, now=106.0)
    agreement = st.judge_agreement(10)
    assert (agreement.window.pairs, agreement.window.agree) == (3, 3)
    assert (agreement.total.pairs, agreement.total.agree) == (4, 3)
    # the window keeps the latest turns by their latest feedback: p2 (106) and p3 (102)
    latest_two = st.judge_agreement(2).window
    assert {(v, f) for v, f, n in latest_two.cells if n} == {(-1, -1), (0, 0)}
    assert [r.judge_sign for r in st.list_feedback("p2")] == [-1, -1]
    assert [r.judge_sign for r in st.list_feedback("p6")] == [None]


def test_metrics_show_the_agreement_read_and_reuse_a_recent_one():
    import asyncio
    import math

    from prometheus_client.parser import text_string_to_metric_families

    from policy_server.metrics import Metrics
    from policy_server.store.feedback import JudgeAgreement, SignCounts

    def values(m: Metrics) -> dict[tuple[str, tuple], float]:
        text = m.render().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name.startswith("hindsight_policy_judge_feedback_")
        }

    m = Metrics()
    empty = values(m)
    assert math.isnan(empty[("hindsight_policy_judge_feedback_agreement", ())])
    assert empty[("hindsight_policy_judge_feedback_pairs", ())] == 0 and len(empty) == 2 + 9
    reads = []

    def read() -> JudgeAgreement:
        reads.append(1)
        window = SignCounts.of({(1, 1): 3, (-1, 1): 1})
        return JudgeAgreement(window_size=200, window=window, total=SignCounts.of({(1, 1): 5, (0, -1): 2}))

    asyncio.run(m.refresh_judge_feedback(read))
    asyncio.run(m.refresh_judge_feedback(read))  # within AGREEMENT_MAX_AGE_S: the same read serves
    assert len(reads) == 1
    got = values(m)
    assert got[("hindsight_policy_judge_feedback_agreement", ())] == 0.75
    assert got[("hindsight_policy_judge_feedback_pairs", ())] == 4
    key = "hindsight_policy_judge_feedback_outcomes_total"
    assert got[(key, (("feedback", "+1"), ("outcome", "agree"), ("verdict", "+1")))] == 5
    assert got[(key, (("feedback", "-1"), ("outcome", "disagree"), ("verdict", "0")))] == 2
    assert got[(key, (("feedback", "0"), ("outcome", "agree"), ("verdict", "0")))] == 0
    asyncio.run(m.refresh_judge_feedback(read, max_age_s=0.0))
    assert len(reads) == 2


def test_concurrent_feedback_excluding_both_included_samples_still_promotes(store_factory):
    """Two feedbacks, each excluding one of a session's two included samples, sent at once from two
    connections: the session's settles queue on its row, so the second sees the first's exclusion and
    promotes the neutral turn (without that, each could see the other's sample still included)."""
    import threading

    st = store_factory()
    sessions = [f"race{i}" for i in range(8)]
    for sid in sessions:
        _session(st, sid, [POS, POS, NEUTRAL])
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def send(turn: int) -> None:
        try:
            for sid in sessions:
                barrier.wait(timeout=10)
                _down(st, sid, turn)
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=send, args=(turn,)) for turn in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    for sid in sessions:
        assert [r[0] for r in _rows(st, sid)] == ["rejected", "rejected", "ready"], sid
        assert st.session(sid).has_included == 1
