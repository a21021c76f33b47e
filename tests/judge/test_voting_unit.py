"""Unit tests of judge_server.voting (fixed rule, adaptive policy, the sequential error-budget rule of
judge_server.vote_model, hint selection) and the rules backend."""

from __future__ import annotations

import itertools

import pytest

from judge_server.rules import RuleJudge
from judge_server.settings import DEFAULT_NEGATIVE, DEFAULT_POSITIVE
from judge_server.vote_model import (
    AgreementTracker,
    _states,
    agreement_from_pair_rate,
    distinct_third_rate,
    fixed_error,
    stop_table,
)
from judge_server.voting import (
    Vote,
    VoteResult,
    is_decided,
    majority_vote,
    next_round_size,
    run_policy,
    select_hint,
)


@pytest.mark.unit
@pytest.mark.parametrize(
    "votes,score,status,confidence",
    [
        ([1, None, None], 1, "ok", 1.0),  # prior rule: one parseable vote decides (fixed keeps it)
        ([1, -1, None], 0, "tie", 0.5),
        ([1, -1, 0], 0, "tie", 1 / 3),
        ([1, 1, -1], 1, "ok", 2 / 3),
        ([-1], -1, "ok", 1.0),
        ([None, None, None], 0, "no_valid_votes", 0.0),
        ([], 0, "no_valid_votes", 0.0),
        ([0, 0, 1], 0, "ok", 2 / 3),  # a genuine 0 verdict is status ok, unlike a tie
    ],
)
def test_majority_vote_fixed_rule(votes, score, status, confidence) -> None:
    r = majority_vote(votes)
    assert (r.score, r.status) == (score, status)
    assert r.confidence == pytest.approx(confidence)
    assert r.votes == votes


@pytest.mark.unit
def test_decided_and_round_size() -> None:
    assert next_round_size([], 3, 1) == 2
    assert next_round_size([], 5, 1) == 3
    assert is_decided([1, 1], 3, 1)
    assert not is_decided([1, -1], 3, 1)
    assert next_round_size([1, -1], 3, 1) == 1
    assert not is_decided([1, 1], 3, 3)  # min_valid
    assert next_round_size([1, 1], 3, 3) == 1
    assert not is_decided([1, -1, 0], 3, 1)
    assert next_round_size([1, -1, 0], 3, 1) == 0
    assert is_decided([1, 1, 1], 5, 1)


def scripted(values: list[int | None]):
    """A sampler that hands out the scripted votes in order and records each call's k."""
    it = iter(values)
    calls: list[int] = []

    async def sample(k: int, round_index: int) -> list[Vote]:
        calls.append(k)
        return [Vote(next(it)) for _ in range(k)]

    return sample, calls


@pytest.mark.unit
async def test_fixed_policy_one_round() -> None:
    sample, calls = scripted([1, -1, 1])
    r = await run_policy(sample, policy="fixed", m=3, m_max=7)
    assert calls == [3] and r.score == 1 and r.status == "ok" and r.rounds == 1


@pytest.mark.unit
async def test_adaptive_stops_when_agreeing() -> None:
    sample, calls = scripted([1, 1, 1, 1, 1])
    r = await run_policy(sample, policy="adaptive", m=5, m_max=9)
    assert calls == [3] and r.votes == [1, 1, 1] and r.score == 1


@pytest.mark.unit
async def test_adaptive_escalates_on_split() -> None:
    sample, calls = scripted([1, -1, 0, 1, 1, 1, 1])
    r = await run_policy(sample, policy="adaptive", m=3, m_max=7, escalate_step=2)
    assert calls == [2, 1, 2] and r.votes == [1, -1, 0, 1, 1] and (r.score, r.status) == (1, "ok")


@pytest.mark.unit
async def test_adaptive_tie_at_m_max() -> None:
    sample, calls = scripted([1, -1, 0, 1, -1, 1, 1])
    r = await run_policy(sample, policy="adaptive", m=3, m_max=5)
    assert calls == [2, 1, 2] and r.votes == [1, -1, 0, 1, -1]
    assert (r.score, r.status) == (0, "tie")  # still split at m_max: a tie, not a verdict


@pytest.mark.unit
async def test_adaptive_min_valid() -> None:
    sample, calls = scripted([1, None, None, None, None])
    r = await run_policy(sample, policy="adaptive", m=3, m_max=5, min_valid=2)
    assert r.status == "no_valid_votes" and r.score == 0 and len(r.votes) == 5
    sample, calls = scripted([1, None, 1])
    r = await run_policy(sample, policy="adaptive", m=3, m_max=5, min_valid=2)
    assert r.status == "ok" and r.score == 1


@pytest.mark.unit
async def test_adaptive_agrees_with_fixed_outcome_when_decided_early() -> None:
    # for every 3-vote pattern over {1,-1}, adaptive(m=3, m_max=3) equals fixed m=3 on the same stream
    for pattern in itertools.product([1, -1], repeat=3):
        s1, _ = scripted(list(pattern))
        s2, _ = scripted(list(pattern))
        fixed = await run_policy(s1, policy="fixed", m=3, m_max=3)
        adaptive = await run_policy(s2, policy="adaptive", m=3, m_max=3)
        assert adaptive.score == fixed.score, pattern


@pytest.mark.unit
async def test_partial_votes_survive_a_failing_round() -> None:
    async def sample(k: int, round_index: int) -> list[Vote]:
        if round_index > 0:
            raise RuntimeError("engine died")
        return [Vote(1), Vote(-1)]

    collected: list[Vote] = []
    with pytest.raises(RuntimeError):
        await run_policy(sample, policy="adaptive", m=3, m_max=5, collected=collected)
    assert [v.value for v in collected] == [1, -1]


@pytest.mark.unit
def test_select_hint_prior_rule_and_majority_option() -> None:
    votes = [
        Vote(1, "short"),
        Vote(1, "  a longer useful hint  "),
        Vote(-1, "the longest hint of a negative vote"),
        Vote(1, "a longer useful hin2"),
    ]
    split = VoteResult(score=-1, status="ok", votes=[1, 1, -1, -1, -1], confidence=0.6)
    assert select_hint(votes, split) == "a longer useful hint"  # prior rule: longest over 10, first on ties
    assert select_hint(votes, split, require_majority=True) is None
    agree = VoteResult(score=1, status="ok", votes=[1, 1, -1], confidence=2 / 3)
    assert select_hint(votes, agree, require_majority=True) == "a longer useful hint"
    assert select_hint([Vote(1, "exactly10c")], agree) is None  # must be longer than 10
    assert select_hint([Vote(1, "exactly11ch")], agree) == "exactly11ch"


RULES = RuleJudge(DEFAULT_POSITIVE, DEFAULT_NEGATIVE)


@pytest.mark.unit
@pytest.mark.parametrize(
    "next_state,verdict",
    [
        ([{"role": "user", "content": "Thanks!"}], 1),
        ([{"role": "user", "content": "That worked perfectly"}], 1),
        ([{"role": "user", "content": "Great, now do the next one"}], 1),
        ([{"role": "user", "content": "correct"}], 1),
        ([{"role": "tool", "content": '{"result": 42}'}], 1),
        ([{"role": "tool", "content": "Error: file not found"}], -1),
        ([{"role": "user", "content": "That's wrong, the capital is Canberra."}], -1),
        ([{"role": "user", "content": "No, I meant the other file."}], -1),
        ([{"role": "user", "content": "That is not what I asked for"}], -1),
        ([{"role": "user", "content": "please redo it"}], -1),
        ([{"role": "user", "content": "incorrect"}], -1),  # not matched as "correct"
        ([{"role": "user", "content": "the build failed"}], -1),
        ([{"role": "user", "content": "thanks, but it's wrong"}], -1),  # negative wins
        ([{"role": "user", "content": "What is the weather tomorrow?"}], 0),
        ([{"role": "user", "content": "nothing to see"}], 0),  # "no," needs the comma; "no" in nothing no match
    ],
)
def test_rules_prm(next_state, verdict) -> None:
    assert RULES.prm_verdict(next_state) == verdict


@pytest.mark.unit
def test_rules_hint_and_version() -> None:
    v = RULES.hint_vote([{"role": "user", "content": "  No, use Celsius instead of Fahrenheit.  "}])
    assert v.value == 1 and v.hint == "No, use Celsius instead of Fahrenheit."
    v = RULES.hint_vote([{"role": "user", "content": "thanks"}])
    assert v.value == -1 and v.hint is None
    assert RULES.version.startswith("rules@") and len(RULES.version) == len("rules@") + 12
    assert RuleJudge(["yay"], ["boo"]).version != RULES.version


# --- sequential policy, error-budget rule (judge_server.vote_model). Expectations derived by hand from the
# one-coin vote model: P(verdict t true | counts) is proportional to (a * (K-1) / (1-a)) ** count_t.


def tracker(
    agreement: float, unparseable: float = 0.05, k: int = 3, prior_turns: int = 10**6, window: int = 10
) -> AgreementTracker:
    """A tracker whose huge warm-up weight pins its estimate to the given noise."""
    return AgreementTracker(
        k, default_agreement=agreement, default_unparseable=unparseable, prior_turns=prior_turns, window_turns=window
    )


@pytest.mark.unit
def test_agreement_from_pair_rate_inverts_the_pair_agreement() -> None:
    assert agreement_from_pair_rate(0.85**2 + 0.15**2 / 2, 3) == pytest.approx(0.85)
    assert agreement_from_pair_rate(0.9**2 + 0.1**2, 2) == pytest.approx(0.9)  # 0.82
    assert agreement_from_pair_rate(0.1, 3) == pytest.approx(1 / 3)  # below chance: clamped to chance


@pytest.mark.unit
def test_fixed_error_hand_derived() -> None:
    assert fixed_error(0.9, 0.0, 2, 3, 1) == pytest.approx(1 - (0.9**3 + 3 * 0.9**2 * 0.1))  # binary, m=3
    assert fixed_error(0.7, 0.0, 3, 2, 1) == pytest.approx(1 - 0.7**2)  # m=2: right only when both agree
    assert fixed_error(0.7, 0.1, 3, 1, 1) == pytest.approx(0.1 + 0.9 * 0.3)  # m=1: unparseable or wrong


@pytest.mark.unit
def test_tracker_estimate_blends_window_with_warm_up_default() -> None:
    t = tracker(0.85, prior_turns=1)
    assert t.estimate() == (0.85, 0.05, 0.5)  # nothing seen yet: the warm-up default, symmetric wrong votes
    for votes in ([1, 1], [1, 0, 1], [None, 1], [1]):  # the single vote is ignored
        t.observe(votes)
    # pairs: 2 parseable, 1 agreeing; pair rate (1 + 0.73375) / (2 + 1) = 0.5779 -> a = 0.737
    # unparseable: (1 of 6 votes + 2 * 0.05) / (6 + 2) = 0.1375; one third vote: far too few to leave symmetry
    assert t.estimate() == (0.74, 0.14, 0.5)
    small = tracker(0.85, prior_turns=1, window=2)
    for votes in ([1, 1], [1, 0, 1], [None, 1]):
        small.observe(votes)
    # the window keeps the last two turns: pair rate 0.73375 / 2 -> a = 0.483; unparseable 1.1 / 6
    assert small.estimate() == (0.48, 0.18, 0.5)


@pytest.mark.unit
def test_tracker_detects_concentrated_wrong_votes() -> None:
    # 700 agreeing pairs, 300 disagreeing ones whose third vote always repeats one of them: wrong votes pile on
    # one rival (the symmetric model at a=0.85 predicts a third verdict after 0.108 of the disagreeing pairs)
    assert distinct_third_rate(0.85, 0.5, 3) == pytest.approx(6 * 0.85 * 0.075**2 / (1 - 0.85**2 - 2 * 0.075**2))
    piled = tracker(0.85, prior_turns=1, window=10_000)
    spread = tracker(0.85, prior_turns=1, window=10_000)
    for _ in range(700):
        piled.observe([1, 1])
        spread.observe([1, 1])
    for _ in range(300):
        piled.observe([1, 0, 1])
        spread.observe([1, 0, -1])
    pair_rate = (700 + 0.85**2 + 0.15**2 / 2) / 1001
    assert piled.estimate() == (round(agreement_from_pair_rate(pair_rate, 3, 0.95), 2), 0.0, 0.95)
    assert spread.estimate() == (round(agreement_from_pair_rate(pair_rate, 3), 2), 0.0, 0.5)


@pytest.mark.unit
def test_stop_table_at_a_two_one_lead_depends_on_the_noise() -> None:
    # after 3 votes 2-1: the leader is wrong w.p. 1/(1+38+1/38) = 0.026 at a=0.95, above fixed m=5's error
    # (0.0026), so the rule goes on; at a=0.85 it is wrong w.p. 0.088 and fixed m=5 w.p. 0.035, but stopping
    # at 2-1 still fits the whole turn's error budget (most turns stop at 2-0 with error 0.015). If wrong votes
    # pile on one rival (c=0.8), a 2-1 lead is more often two wrong votes: the rule goes on.
    assert ((2, 1, 0), 0) not in stop_table(0.95, 0.05, 3, 5, 9, 2, 1, 1.0)
    assert ((2, 1, 0), 0) in stop_table(0.85, 0.05, 3, 5, 9, 2, 1, 1.0)
    assert ((2, 1, 0), 0) not in stop_table(0.85, 0.05, 3, 5, 9, 2, 1, 1.0, 0.8)
    for a in (0.95, 0.85, 0.7, 0.55):
        table = stop_table(a, 0.05, 3, 5, 9, 2, 1, 1.0)
        assert ((2, 0, 0), 0) in table and ((1, 1, 0), 0) not in table  # a tie never ends a turn early
        assert set(_states(9, 3)) <= table  # m_max votes always stop


def error_budget_run(values: list[int | None], t: AgreementTracker, **kw: object):
    sample, calls = scripted(values)
    args = {"policy": "sequential", "m": 5, "m_max": 9, "stop_rule": "error_budget", "tracker": t, **kw}
    return run_policy(sample, **args), calls


@pytest.mark.unit
async def test_error_budget_policy_on_hand_built_streams() -> None:
    run, calls = error_budget_run([1, 1, -1, -1, -1], tracker(0.95))
    r = await run
    assert (r.score, r.status, r.votes, calls) == (1, "ok", [1, 1], [2])  # 2-0: stop
    run, calls = error_budget_run([1, 0, 1, 1, 0], tracker(0.95))
    r = await run
    assert (r.score, r.votes, calls) == (1, [1, 0, 1, 1], [2, 1, 1])  # 2-1 goes on at 0.95; 3-1 stops
    run, calls = error_budget_run([1, 0, 1, 1, 0], tracker(0.85))
    r = await run
    assert (r.score, r.votes, calls) == (1, [1, 0, 1], [2, 1])  # a noisier judge stops at 2-1
    run, calls = error_budget_run([1, 0, -1, 1, 0, -1, None, None, None, 1], tracker(0.85), m_max=7)
    r = await run
    assert (r.status, len(r.votes)) == ("tie", 7)  # still split at m_max: a tie
    run, calls = error_budget_run([-1, -1, 1], tracker(0.9, k=2), outcomes=(1, -1))
    r = await run
    assert (r.score, r.votes) == (-1, [-1, -1])  # the hint task's two verdicts


@pytest.mark.unit
async def test_error_budget_policy_feeds_the_tracker_its_first_two_votes() -> None:
    t = tracker(0.85, prior_turns=1)
    run, _ = error_budget_run([1, 0, 1, 1], t)
    await run
    assert list(t._turns) == [(2, 0, 0)]  # a parseable disagreeing pair, then one of its two verdicts
    with pytest.raises(ValueError, match="AgreementTracker"):
        run, _ = error_budget_run([1, 1], None)  # type: ignore[arg-type]
        await run
