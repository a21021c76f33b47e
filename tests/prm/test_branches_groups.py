"""Branches and groups: each root-to-leaf branch scored on a clone (shared ancestors
get branch-local scores, the session cache untouched), metrics only when every branch succeeds; a missing or
failed session rejects its group, discard skips scoring, a consumed trajectory is never rescored; the two
group filters."""

from __future__ import annotations

import pytest

from prm import (
    BaseScorer,
    PRMRejected,
    PRMRunner,
    ReadyTrajectories,
    TurnCache,
    filter_mixed_or_penalized_all_wrong,
    filter_mixed_or_penalized_all_wrong_mask_no_eos,
    score_branches,
    score_group,
)
from tests.prm.prm_test_scorers import LOG, A, Scripted, make_turns

pytestmark = pytest.mark.unit


class LeafAware(BaseScorer):
    """Scores every turn with the number of messages in the branch conversation (branch-dependent)."""

    name = "leaf_aware"

    async def evaluate(self, interaction, ctx):
        if ctx["messages"][-1]["content"] == "fail":
            raise ValueError("branch judged unscorable")
        return float(len(ctx["messages"]))


def tree_turns(fail_branch: bool = False) -> list[dict]:
    # turn 0 is shared; turn 1 (short branch) and turn 2 (longer context) are both its children.
    base = make_turns(3)
    base[1]["parent_turn_index"] = 0
    base[2]["parent_turn_index"] = 0
    base[2]["messages"] = base[0]["messages"] + [
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "retry"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "again"},
    ]
    if fail_branch:
        base[2]["response"] = {**base[2]["response"], "content": "fail"}
    return base


async def test_shared_ancestor_gets_branch_local_scores_on_clones():
    runner = PRMRunner({"scorers": [LeafAware()]})
    cache = TurnCache.from_turns(tree_turns())
    result = await score_branches(runner, cache)
    assert [b.leaf_id for b in result.branches] == ["s1:1", "s1:2"]
    short, long = result.branches
    assert short.turn_indices == (0, 1) and long.turn_indices == (0, 2)
    assert short.token_rewards[0] == [4.0, 4.0]  # q0 a0 q1 a1
    assert long.token_rewards[0] == [6.0, 6.0]  # q0 a0 retry x again a2: same turn, other branch
    assert all(cache.token_rewards(iid) is None for iid, _ in cache.items())  # session cache untouched
    assert result.token_rewards_by_turn()[0] == [4.0, 4.0]  # first branch wins for the flat view
    snap = runner.metrics.snapshot()
    assert snap["rollout/prm_turn_reward/leaf_aware"] == pytest.approx((4 + 4 + 6 + 6) / 4)
    assert snap["rollout/prm_trajectory_reward/leaf_aware"] == pytest.approx((8 + 12) / 2)


async def test_no_metrics_unless_every_branch_succeeds():
    runner = PRMRunner({"scorers": [LeafAware()]})
    with pytest.raises(PRMRejected, match="branch judged unscorable"):
        await score_branches(runner, TurnCache.from_turns(tree_turns(fail_branch=True)))
    assert runner.metrics.snapshot() == {}  # the first branch succeeded but published nothing
    assert runner.metrics.sessions == {("rollout", "rejected"): 1}


def evaluations() -> int:
    return sum(1 for event, _ in LOG if event == "evaluate")


async def test_missing_session_rejects_group_but_scored_ones_publish():
    runner = PRMRunner({"scorers": [A()]})
    ready = ReadyTrajectories()
    ready.put("g1", make_turns(2, session_id="g1"))
    result = await score_group(runner, ready, ["g1", "g2"])
    assert not result.accepted and "g2" in result.reason and "no ready trajectory" in result.reason
    assert set(result.scored) == {"g1"}
    assert runner.metrics.snapshot()["rollout/prm_turn_reward/a"] == 1.0  # g1's observations still count


async def test_failed_session_rejects_group():
    runner = PRMRunner({"scorers": [Scripted({0: 1.0, 1: None})]})
    ready = ReadyTrajectories()
    ready.put("ok", make_turns(1, session_id="ok"))
    ready.put("bad", make_turns(2, session_id="bad"))
    result = await score_group(runner, ready, ["ok", "bad"])
    assert not result.accepted and "scoring failed" in result.failures["bad"]
    assert runner.metrics.sessions == {("rollout", "scored"): 1, ("rollout", "rejected"): 1}


async def test_discard_skips_scoring_and_consumes():
    runner = PRMRunner({"scorers": [A()]})
    ready = ReadyTrajectories()
    ready.put("d1", make_turns(2, session_id="d1"))
    result = await score_group(runner, ready, ["d1"], discard=True)
    assert not result.accepted and result.reason == "discarded"
    assert evaluations() == 0 and "d1" not in ready


async def test_ready_trajectory_consumed_once_retry_not_rescored():
    runner = PRMRunner({"scorers": [A()]})
    ready = ReadyTrajectories()
    ready.put("r1", make_turns(2, session_id="r1"))
    first = await score_group(runner, ready, ["r1"])
    assert first.accepted and first.scored["r1"].token_rewards_by_turn() == {0: [1.0, 1.0], 1: [1.0, 1.0, 1.0]}
    assert evaluations() == 2
    retry = await score_group(runner, ready, ["r1"])
    assert not retry.accepted and "already consumed" in retry.failures["r1"]
    assert evaluations() == 2  # the scorer never ran again


def sample(reward, token_rewards, loss_mask=None, response_ids=(5, 2)):
    return {
        "reward": reward,
        "token_rewards": token_rewards,
        "loss_mask": loss_mask or [1] * len(token_rewards),
        "response_ids": list(response_ids),
    }


@pytest.mark.parametrize(
    "group, keep",
    [
        ([sample(1.0, [0, 0]), sample(-1.0, [0, 0])], True),  # mixed
        ([sample(1.0, [-1, -1]), sample(1.0, [-1, -1])], False),  # all correct
        ([sample(-1.0, [0, 0]), sample(0.0, [0, 0])], True),  # mixed (different values)
        ([sample(-1.0, [0, 0]), sample(-1.0, [0, -0.5])], True),  # all wrong, penalized
        ([sample(-1.0, [0, 0]), sample(-1.0, [0, -0.5], loss_mask=[1, 0])], False),  # penalty on masked token
        ([sample(-1.0, [0, 0]), sample(-1.0, [0, 0])], False),  # all wrong, no signal
    ],
)
def test_filter_mixed_or_penalized_all_wrong(group, keep):
    assert filter_mixed_or_penalized_all_wrong(group) is keep


def test_filter_mask_no_eos_ignores_truncated_penalties():
    eos = {2}
    truncated = sample(-1.0, [0, -0.5], response_ids=(5, 6))
    finished = sample(-1.0, [0, -0.5], response_ids=(5, 2))
    clean = sample(-1.0, [0, 0])
    assert filter_mixed_or_penalized_all_wrong([clean, truncated]) is True
    assert filter_mixed_or_penalized_all_wrong_mask_no_eos([clean, truncated], eos) is False
    assert filter_mixed_or_penalized_all_wrong_mask_no_eos([clean, finished], eos) is True
    assert filter_mixed_or_penalized_all_wrong_mask_no_eos([clean, {**finished, "truncated": True}], eos) is False


def test_filters_reject_bad_groups():
    with pytest.raises(ValueError, match="at least one sample"):
        filter_mixed_or_penalized_all_wrong([])
    with pytest.raises(ValueError, match="finite outcome reward"):
        filter_mixed_or_penalized_all_wrong([sample(None, [0])])
    with pytest.raises(ValueError, match="lengths differ"):
        filter_mixed_or_penalized_all_wrong([sample(-1.0, [0, -1], loss_mask=[1])])
