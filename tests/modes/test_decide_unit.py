"""Unit tests of the reward-mode decision table (policy_server.rewards.modes, docs/REWARD_MODES.md).

Contract under test: rl trains on PRM +-1 only, neutral verdicts (score 0, tie) are excluded unless the
at-least-one guarantee promotes the session's first one (reward 0.0), no_valid_votes and judge_failed
are never included; opd trains only on accepted hints; combine carries each term that exists with
presence flags and rejects a turn whose judge tasks failed or that has neither term. A judge guard's
quarantine (a hit, or a verdict ``quarantined``) rejects ``degenerate: <rule>: <detail>`` in every mode,
never promoted, never re-decidable by feedback; ``abstained`` is rejected ``prm_abstained: <rule>``.
"""

from __future__ import annotations

import math

import pytest

from engine.records import GuardHit, HintVerdict, PrmVerdict
from policy_server.rewards.modes import (
    InvalidMode,
    ModeSnapshot,
    ModeState,
    build_sample,
    classify_hint,
    classify_prm,
    decide,
)
from policy_server.settings import PolicySettings
from policy_server.store.feedback_rule import applicable

pytestmark = pytest.mark.unit


def prm(score, status="ok"):
    return PrmVerdict.model_validate(
        {"score": score, "status": status, "votes": [score], "confidence": 1.0, "reason": None}
    )


def hint(accepted, text="Use the other file, it is in /tmp.", status="ok"):
    return HintVerdict.model_validate(
        {
            "accepted": accepted,
            "hint": text if accepted else None,
            "votes": [1 if accepted else -1],
            "status": status,
            "reason": None,
        }
    )


FAILED_PRM = PrmVerdict.model_validate(
    {"score": None, "status": "judge_failed", "votes": [], "confidence": 0.0, "reason": "engine down"}
)
FAILED_HINT = HintVerdict.model_validate(
    {"accepted": False, "hint": None, "votes": [], "status": "judge_failed", "reason": "engine down"}
)


@pytest.mark.parametrize(
    ("verdict", "kind", "reason"),
    [
        (prm(1), "signal", ""),
        (prm(-1), "signal", ""),
        (prm(0), "neutral", "prm_neutral"),
        (prm(0, "tie"), "neutral", "prm_tie"),
        (prm(None, "tie"), "neutral", "prm_tie"),
        (prm(0, "no_valid_votes"), "no_verdict", "prm_no_valid_votes"),
        (FAILED_PRM, "failed", "judge_failed: prm: engine down"),
        (None, "failed", "judge_failed: prm: verdict missing from judge response"),
        (prm(2), "failed", "judge_failed: prm: unexpected verdict status='ok' score=2"),
    ],
)
def test_classify_prm(verdict, kind, reason):
    assert classify_prm(verdict) == (kind, reason)


@pytest.mark.parametrize(
    ("verdict", "kind", "reason"),
    [
        (hint(True), "accepted", ""),
        (hint(False), "none", "no_hint"),
        (HintVerdict(accepted=True, hint="   ", votes=[1], status="ok"), "none", "no_hint"),
        (FAILED_HINT, "failed", "judge_failed: hint: engine down"),
        (None, "failed", "judge_failed: hint: verdict missing from judge response"),
    ],
)
def test_classify_hint(verdict, kind, reason):
    assert classify_hint(verdict) == (kind, reason)


# (mode, prm, hint, session_has_included, at_least_one) -> (include, reason, use_reward, need_teacher, promoted)
CASES = [
    ("rl", prm(1), None, False, True, (True, None, True, False, False)),
    ("rl", prm(-1), None, True, True, (True, None, True, False, False)),
    ("rl", prm(0), None, False, True, (True, None, True, False, True)),
    ("rl", prm(0), None, True, True, (False, "prm_neutral", False, False, False)),
    ("rl", prm(0), None, False, False, (False, "prm_neutral", False, False, False)),
    ("rl", prm(None, "tie"), None, False, True, (True, None, True, False, True)),
    ("rl", prm(0, "no_valid_votes"), None, False, True, (False, "prm_no_valid_votes", False, False, False)),
    ("rl", FAILED_PRM, None, False, True, (False, "judge_failed: prm: engine down", False, False, False)),
    ("opd", None, hint(True), False, True, (True, None, False, True, False)),
    ("opd", None, hint(False), False, True, (False, "no_hint", False, False, False)),
    ("opd", None, FAILED_HINT, False, True, (False, "judge_failed: hint: engine down", False, False, False)),
    ("combine", prm(1), hint(True), True, True, (True, None, True, True, False)),
    ("combine", prm(-1), hint(False), True, True, (True, None, True, False, False)),
    ("combine", prm(0), hint(True), True, True, (True, None, False, True, False)),
    ("combine", prm(0), hint(False), True, True, (False, "no_signal: prm_neutral, no_hint", False, False, False)),
    ("combine", prm(0), hint(False), False, True, (True, None, True, False, True)),
    (
        "combine",
        prm(0, "no_valid_votes"),
        hint(False),
        False,
        True,
        (False, "no_signal: prm_no_valid_votes, no_hint", False, False, False),
    ),
    ("combine", FAILED_PRM, hint(True), False, True, (False, "judge_failed: prm: engine down", False, False, False)),
    ("combine", prm(1), FAILED_HINT, False, True, (False, "judge_failed: hint: engine down", False, False, False)),
]


@pytest.mark.parametrize(("mode", "p", "h", "has_inc", "alo", "expected"), CASES)
def test_decide_table(mode, p, h, has_inc, alo, expected):
    d = decide(mode, p, h, session_has_included=has_inc, at_least_one=alo)
    assert (d.include, d.reason, d.use_reward, d.need_teacher, d.promoted) == expected


def test_decide_unknown_mode():
    with pytest.raises(InvalidMode):
        decide("sft", prm(1), None, session_has_included=False, at_least_one=True)


def test_mode_state_validates_and_keeps_unset_values():
    st = ModeState("rl", 1.0, 1.0)
    snap = st.set("combine", w_rl=0.5)
    assert snap == ModeSnapshot(mode="combine", w_rl=0.5, w_opd=1.0)
    assert st.snapshot().model_dump() == {"mode": "combine", "w_rl": 0.5, "w_opd": 1.0}
    bad_sets = [
        ("sft", None, None),
        (None, -1.0, None),
        (None, None, math.nan),
        (None, "x", None),
        (None, None, math.inf),
    ]
    for bad in bad_sets:
        with pytest.raises(InvalidMode):
            st.set(*bad)
    assert st.snapshot() == ModeSnapshot(mode="combine", w_rl=0.5, w_opd=1.0)  # a rejected set changes nothing
    with pytest.raises(InvalidMode):
        ModeState("rlhf")


def test_mode_state_from_settings_defaults():
    # The defaults of the fields not given come from the settings class itself.
    settings = PolicySettings.model_construct(mode="opd", w_opd=2.0)

    assert ModeState.from_settings(settings).snapshot() == ModeSnapshot(mode="opd", w_rl=1.0, w_opd=2.0)


def test_build_sample_shapes_and_flags():
    snap = ModeSnapshot(mode="combine", w_rl=0.3, w_opd=0.7)
    s = build_sample(
        snap,
        4,
        include=True,
        prm=prm(1),
        hint=hint(True),
        reward=1.0,
        teacher_logprobs=[-1.0, -2.0, -3.0, -4.0],
        teacher_topk=None,
    )
    assert s.loss_mask == [1, 1, 1, 1]
    assert (s.has_reward, s.has_teacher, s.reward) == (True, True, 1.0)
    assert (s.mode, s.w_rl, s.w_opd, s.token_rewards) == ("combine", 0.3, 0.7, None)
    assert s.prm == prm(1) and s.hint == hint(True)  # the verdicts travel as records
    r = build_sample(
        snap, 3, include=False, prm=prm(0), hint=None, reward=None, teacher_logprobs=None, teacher_topk=None
    )
    assert r.loss_mask == [0, 0, 0]
    assert (r.has_reward, r.has_teacher, r.reward, r.teacher_logprobs) == (False, False, None, None)
    assert "teacher_logprobs" in r.to_json() and "hint" in r.to_json()  # written as null, as before


# ---------------------------------------------------------------------------- judge guards
DEGENERATE_HIT = GuardHit(rule="degenerate", action="quarantine", detail="one unit repeated 40 times: '!'")
QUARANTINED_PRM = PrmVerdict.model_validate(
    {
        "score": None,
        "status": "quarantined",
        "votes": [0, 0, 0],
        "confidence": 0.0,
        "reason": "guard degenerate: one unit repeated 40 times: '!'",
        "guards": [DEGENERATE_HIT.to_json()],
    }
)
QUARANTINED_HINT = HintVerdict.model_validate(
    {"accepted": False, "hint": None, "votes": [1], "status": "quarantined", "reason": "guard truncated: cut"}
)
ABSTAINED_PRM = PrmVerdict.model_validate(
    {
        "score": None,
        "status": "abstained",
        "votes": [1],
        "confidence": 0.0,
        "reason": "guard tool_error: x",
        "guards": [{"rule": "tool_error", "action": "abstain", "detail": "x"}],
    }
)
DEGENERATE = "degenerate: degenerate: one unit repeated 40 times: '!'"


@pytest.mark.parametrize(
    ("mode", "p", "h"),
    [
        ("rl", prm(0), None),  # neutral: at-least-one would promote it without the hit
        ("rl", prm(1), None),  # even a +1 vote
        ("opd", None, hint(True)),  # even an accepted hint
        ("combine", prm(0), hint(True)),
        ("combine", FAILED_PRM, FAILED_HINT),  # before a judge failure (which feedback could re-decide)
    ],
)
def test_a_quarantine_hit_rejects_in_every_mode_and_is_never_promoted(mode, p, h):
    d = decide(mode, p, h, session_has_included=False, at_least_one=True, guards=[DEGENERATE_HIT])
    assert (d.include, d.reason, d.promoted, d.use_reward, d.need_teacher) == (False, DEGENERATE, False, False, False)
    assert decide(mode, p, h, session_has_included=False, at_least_one=True).reason != DEGENERATE


def test_an_override_or_abstain_hit_alone_does_not_quarantine():
    override = GuardHit(rule="tool_error", action="override", detail="x")
    d = decide("rl", prm(-1), None, session_has_included=True, at_least_one=True, guards=[override])
    assert (d.include, d.use_reward) == (True, True)


@pytest.mark.parametrize(
    ("mode", "p", "h", "reason"),
    [
        ("rl", QUARANTINED_PRM, None, DEGENERATE),  # the verdict's own hits
        ("opd", None, QUARANTINED_HINT, "degenerate: truncated: cut"),  # the status and reason alone
        ("combine", prm(0), QUARANTINED_HINT, "degenerate: truncated: cut"),
    ],
)
def test_a_quarantined_verdict_rejects_without_the_answers_hits(mode, p, h, reason):
    d = decide(mode, p, h, session_has_included=False, at_least_one=True)
    assert (d.include, d.reason, d.promoted) == (False, reason, False)


def test_abstained_is_rejected_like_no_valid_votes_and_never_promoted():
    assert classify_prm(ABSTAINED_PRM) == ("no_verdict", "prm_abstained: tool_error")
    d = decide("rl", ABSTAINED_PRM, None, session_has_included=False, at_least_one=True)
    assert (d.include, d.reason, d.promoted) == (False, "prm_abstained: tool_error", False)
    # combine: the hint alone still trains, as with no_valid_votes
    d = decide("combine", ABSTAINED_PRM, hint(True), session_has_included=False, at_least_one=True)
    assert (d.include, d.use_reward, d.need_teacher) == (True, False, True)


def test_quarantine_and_abstain_reasons_are_not_redecidable_by_feedback():
    assert not applicable("rejected", DEGENERATE)
    assert not applicable("rejected", "prm_abstained: tool_error")
