"""Unit tests of the sequential stopping rule (judge_server.voting: ``change_probability``, policy ``sequential``).

Contract: the change probability is the Dirichlet-multinomial predictive mass of the next ``remaining`` votes
under which another verdict reaches the leader's count (values below derived by hand from the Polya urn:
each next vote goes to a category with probability (count + prior) / (votes + 4 * prior), categories =
the three PRM verdicts and "unparseable"); no strict leader -> 1.0; nothing left -> 0.0.
The policy draws a first round of ``first_round`` votes, then one per round, stops when the result is ok and
that probability is below ``stop_change_prob``, and escalates a split result by ``escalate_step`` up to m_max.
"""

from __future__ import annotations

import inspect

import pytest

from judge_server import voting
from judge_server.settings import JudgeSettings
from judge_server.voting import Vote, change_probability, run_policy

pytestmark = pytest.mark.unit
PRM = (1, 0, -1)


@pytest.mark.parametrize(
    ("votes", "remaining", "prior", "expected"),
    [
        ([1, 1], 1, 0.5, 0.0),  # one more vote brings another verdict to 1 < 2
        ([1, 1, 0], 1, 0.5, 1.5 / 5),  # the next vote is 0 (2-2 tie): (1 + .5) / (3 + 2)
        ([1, 1, 0], 1, 1.0, 2 / 7),  # (1 + 1) / (3 + 4)
        ([1, None], 1, 0.5, 1.0 / 4),  # 0 or -1 ties the leader: 2 * .5 / (2 + 2)
        ([1, 1], 2, 0.5, 2 * (0.5 / 4) * (1.5 / 5)),  # both go to the same other verdict: urn .5/4 then 1.5/5
        ([1, 0], 3, 0.5, 1.0),  # no strict leader
        ([], 5, 0.5, 1.0),
        ([-1, -1, -1], 0, 0.5, 0.0),
    ],
)
def test_change_probability_hand_derived(votes, remaining, prior, expected):
    assert change_probability(votes, remaining, PRM, prior) == pytest.approx(expected)


def test_change_probability_monotone():
    assert change_probability([1, 1], 3, PRM, 0.5) < change_probability([1, 1], 3, PRM, 2.0)  # weaker belief
    assert change_probability([1, 1, 1], 2, PRM, 0.5) < change_probability([1, 1], 3, PRM, 0.5)  # more evidence
    assert change_probability([1, 1, None], 2, PRM, 0.5) < change_probability([1, 1, 0], 2, PRM, 0.5)
    assert change_probability([1, 1], 3, (1, -1), 0.5) < change_probability([1, 1], 3, PRM, 0.5)  # fewer rivals


def scripted(values):
    calls: list[int] = []
    stream = list(values)

    async def sample(k: int, round_index: int) -> list[Vote]:
        assert round_index == len(calls)
        calls.append(k)
        out = [Vote(v) for v in stream[:k]]
        del stream[:k]
        return out

    return sample, calls


async def _run(values, **kw):
    sample, calls = scripted(values)
    args = {"policy": "sequential", "m": 5, "m_max": 9, "stop_rule": "change_prob", "stop_prior": 0.5, **kw}
    return await run_policy(sample, **args), calls


async def test_two_agreeing_votes_stop():
    r, calls = await _run([1, 1, -1, -1, -1])  # P(change) of [1, 1] with 3 left is 0.069 < 0.1
    assert (r.score, r.status, r.votes, calls) == (1, "ok", [1, 1], [2])


async def test_split_then_one_vote_per_round():
    # [1,0] tie -> [1,0,1]: P(change) with 2 left = 0.25 -> [1,0,1,1]: 3-1 with 1 left cannot change
    r, calls = await _run([1, 0, 1, 1, 0])
    assert (r.score, r.votes, calls) == (1, [1, 0, 1, 1], [2, 1, 1])
    r, calls = await _run([1, 0, 1, 1, 0], stop_change_prob=0.3)  # a looser setting stops at 2-1
    assert (r.score, r.votes, calls) == (1, [1, 0, 1], [2, 1])


async def test_split_budget_escalates_to_m_max():
    # five votes end 2-2-1 -> budget 7: 1 leads 3-2 with 1 left (P = 2.5/8 > .1) -> 4-2 with none left
    r, calls = await _run([1, 0, -1, 0, 1, 1, 1, 0])
    assert (r.score, r.status, len(r.votes)) == (1, "ok", 7)
    r, _ = await _run([1, 0, -1, 1, 0, -1, None, None, None, 1], m_max=7)  # still split at m_max: a tie
    assert (r.status, len(r.votes)) == ("tie", 7)


async def test_min_valid_and_first_round():
    r, calls = await _run([None, 1, 1, 1, 1], min_valid=2, first_round=3)
    assert calls[0] == 3 and r.score == 1 and sum(v is not None for v in r.votes) >= 2
    r, calls = await _run([None] * 9)
    assert (r.status, len(r.votes)) == ("no_valid_votes", 9)


async def test_never_more_than_fixed_when_unanimous():
    for v in (1, 0, -1):
        r, _ = await _run([v] * 9, stop_change_prob=0.25)
        assert (r.score, len(r.votes)) == (v, 2)


def test_run_policy_defaults_are_the_services():
    """One copy of the voting defaults: a caller of run_policy without settings gets the service's rule."""
    service = {name: f.default for name, f in JudgeSettings.model_fields.items()}
    defaults = {p.name: p.default for p in inspect.signature(run_policy).parameters.values()}
    pairs = {
        "stop_rule": "sequential_stop_rule",
        "stop_change_prob": "stop_change_prob",
        "stop_prior": "stop_prior",
        "first_round": "sequential_first_round",
        "min_valid": "min_valid",
        "escalate_step": "escalate_step",
        "error_budget_share": "error_budget_share",
    }
    assert {k: defaults[k] for k in pairs} == {k: service[v] for k, v in pairs.items()}
    assert (service["sequential_stop_rule"], service["stop_change_prob"]) == (voting.STOP_RULE, voting.STOP_CHANGE_PROB)


async def test_default_stop_rule_needs_the_vote_noise_tracker():
    with pytest.raises(ValueError, match="AgreementTracker"):
        await _run([1, 1, 1], stop_rule=voting.STOP_RULE)
