"""Unit tests of judge_server.voting (fixed rule, adaptive policy, hint selection) and the rules backend."""

from __future__ import annotations

import itertools

import pytest

from judge_server.rules import RuleJudge
from judge_server.settings import DEFAULT_NEGATIVE, DEFAULT_POSITIVE
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
def test_majority_vote_fixed_rule(votes, score, status, confidence) -> None:  # noqa: ANN001
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


def scripted(values: list[int | None]):  # noqa: ANN201
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
    votes = [Vote(1, "short"), Vote(1, "  a longer useful hint  "), Vote(-1, "the longest hint of a negative vote"),
             Vote(1, "a longer useful hin2")]
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
def test_rules_prm(next_state, verdict) -> None:  # noqa: ANN001
    assert RULES.prm_verdict(next_state) == verdict


@pytest.mark.unit
def test_rules_hint_and_version() -> None:
    v = RULES.hint_vote([{"role": "user", "content": "  No, use Celsius instead of Fahrenheit.  "}])
    assert v.value == 1 and v.hint == "No, use Celsius instead of Fahrenheit."
    v = RULES.hint_vote([{"role": "user", "content": "thanks"}])
    assert v.value == -1 and v.hint is None
    assert RULES.version.startswith("rules@") and len(RULES.version) == len("rules@") + 12
    assert RuleJudge(["yay"], ["boo"]).version != RULES.version
