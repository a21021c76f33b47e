"""Scorer contract: broadcast/dense rewards, weighted sums, rejection on None or
exception, read-only inputs, trajectory scorers (order, missing ids 0, unknown ids rejected), per-scorer
all-or-nothing commits, and token rewards aligned to generated tokens."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from prm import (
    BaseScorer,
    BaseTrajectoryScorer,
    PRMInputError,
    PRMRejected,
    PRMRunner,
    TurnCache,
    score_session,
)
from tests.prm.prm_test_scorers import A, B, Scripted, Trajectory, dense, make_turns

pytestmark = pytest.mark.unit


def runner_of(*scorers: BaseScorer, mode: str = "additive") -> PRMRunner:
    return PRMRunner({"scorers": list(scorers), "advantage_shaping": {"mode": mode}})


def test_name_is_required():
    class Nameless(BaseScorer):
        async def evaluate(self, interaction, ctx):
            return 1.0

    with pytest.raises(ValueError, match="non-empty class-level `name`"):
        Nameless()


async def test_scalar_broadcast_weighted_sum_over_generated_tokens(turns3):
    runner = runner_of(A(reward=0.5, weight=2.0), B(reward=-0.25, weight=4.0))
    rewards = await score_session(runner, turns3)
    assert sorted(rewards) == [0, 1, 2]
    for turn in turns3:
        got = rewards[turn["turn_index"]]
        assert len(got) == len(turn["response_ids"])  # generated tokens only, no prompt positions
        assert got == pytest.approx([0.5 * 2.0 - 0.25 * 4.0] * len(got))


async def test_dense_tensor_kept_per_token():
    turns = make_turns(2, out_lens=[3, 2])
    runner = runner_of(Scripted({0: dense([0.1, 0.2, 0.3]), 1: dense([1.0, -1.0])}, weight=10.0))
    rewards = await score_session(runner, turns)
    assert rewards[0] == pytest.approx([1.0, 2.0, 3.0])
    assert rewards[1] == pytest.approx([10.0, -10.0])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dense([1.0, 2.0]), r"shape \(3,\)"),  # wrong length
        (dense([1.0, float("nan"), 0.0]), "non-finite"),
        ("0.5", "number or a \\[output_len\\] tensor"),
        (lambda i, c: float("inf"), "non-finite"),
    ],
)
async def test_invalid_results_reject(bad, match):
    turns = make_turns(1, out_lens=[3])
    with pytest.raises(PRMRejected, match=match):
        await score_session(runner_of(Scripted({0: bad})), turns)


async def test_none_rejects_and_zero_is_a_score(turns3):
    with pytest.raises(PRMRejected, match="returned None for 1/3 turns"):
        await score_session(runner_of(Scripted({0: 1.0, 1: None, 2: 1.0})), turns3)
    rewards = await score_session(runner_of(Scripted({0: 0.0, 1: 0.0, 2: 0.0})), turns3)
    assert all(v == 0.0 for r in rewards.values() for v in r)


async def test_exception_rejects_with_cause(turns3):
    boom = KeyError("verifier down")
    with pytest.raises(PRMRejected, match="raised on 1/3 turns") as info:
        await score_session(runner_of(Scripted({0: 1.0, 1: boom, 2: 1.0})), turns3)
    assert info.value.__cause__ is boom
    assert info.value.scorer == "scripted"


async def test_cancellation_is_not_a_rejection(turns3):
    started = asyncio.Event()

    async def slow(interaction, ctx):
        started.set()
        await asyncio.sleep(30)

    class Slow(BaseScorer):
        name = "slow"

        async def evaluate(self, interaction, ctx):
            return await slow(interaction, ctx)

    task = asyncio.create_task(score_session(runner_of(Slow()), turns3))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_inputs_are_read_only_and_ctx_holds_branch_conversation(turns3):
    seen = {}

    def check(interaction, ctx):
        with pytest.raises(TypeError):
            ctx["messages"][0]["content"] = "changed"
        with pytest.raises(TypeError):
            interaction.messages[0]["content"] = "changed"
        with pytest.raises((TypeError, AttributeError)):
            ctx["messages"].append({})
        seen[interaction.turn_index] = [m["content"] for m in ctx["messages"]]
        assert ctx["is_eval"] is False
        return 1.0

    await score_session(runner_of(Scripted({0: check, 1: check, 2: check})), turns3)
    # Every turn of the branch sees the whole branch: last context + last answer.
    assert seen[0] == seen[2] == ["q0", "a0", "q1", "a1", "q2", "a2"]
    assert turns3[0]["messages"][0]["content"] == "q0"


async def test_trajectory_scorer_order_missing_zero_unknown_rejected():
    # Insert children before parents: the scorer must still get parent-before-child order.
    turns = make_turns(3)
    for t in turns:
        t["parent_turn_index"] = t["turn_index"] - 1 if t["turn_index"] else None
    shuffled = [turns[2], turns[0], turns[1]]
    traj = Trajectory(lambda its: {its[0].interaction_id: 1.0, its[2].interaction_id: torch.tensor([0.5] * 4)})
    rewards = await score_session(runner_of(traj), shuffled)
    assert traj.seen == [["s1:0", "s1:1", "s1:2"]]
    assert rewards == {0: [1.0, 1.0], 1: [0.0, 0.0, 0.0], 2: [0.5] * 4}

    with pytest.raises(PRMRejected, match=r"unknown interaction ids \['s1:9'\]"):
        await score_session(runner_of(Trajectory(lambda its: {"s1:9": 1.0})), turns)
    with pytest.raises(PRMRejected, match="returned None"):
        await score_session(runner_of(Trajectory(lambda its: None)), turns)
    with pytest.raises(PRMRejected, match="returned None for"):
        await score_session(runner_of(Trajectory(lambda its: {"s1:1": None})), turns)


async def test_trajectory_scorer_per_turn_evaluate_raises():
    class T(BaseTrajectoryScorer):
        name = "t"

    with pytest.raises(RuntimeError, match="trajectory scorer"):
        await T().evaluate(None, {})


async def test_commit_only_after_all_results_of_a_scorer_validate(turns3):
    cache = TurnCache.from_turns(turns3)
    good = Scripted({0: 1.0, 1: 1.0, 2: 1.0})

    class Partial(BaseScorer):
        name = "partial"

        async def evaluate(self, interaction, ctx):
            return 5.0 if interaction.turn_index < 2 else float("nan")

    runner = runner_of(good, Partial())
    with pytest.raises(PRMRejected, match="partial"):
        await runner.run(cache)
    # The first scorer committed; none of the failing scorer's valid turns leaked in.
    for iid, _ in cache.items():
        assert cache.token_rewards(iid).tolist() == [1.0] * len(cache.get(iid).response_ids)
    assert runner.metrics.snapshot() == {}


async def test_process_weighted_requires_unit_interval(turns3):
    with pytest.raises(PRMRejected, match=r"token rewards in \[0, 1\]"):
        await score_session(runner_of(A(reward=0.6), B(reward=0.6), mode="process_weighted"), turns3)
    rewards = await score_session(runner_of(A(reward=0.4), B(reward=0.6), mode="process_weighted"), turns3)
    assert all(math.isclose(v, 1.0) for r in rewards.values() for v in r)


async def test_scoring_needs_token_backed_turns(turns3):
    turns3[1]["response_ids"] = []
    with pytest.raises(PRMInputError, match="token-backed turns; response_ids"):
        await score_session(runner_of(A()), turns3)
    del turns3[1]["response_ids"]
    with pytest.raises(PRMInputError, match="turn_index=1"):
        await score_session(runner_of(A()), turns3)


async def test_shared_scorer_across_concurrent_sessions():
    # One instance serves many sessions at once; results must not bleed between them.
    async def per_turn(interaction, ctx):
        await asyncio.sleep(0.001 * (3 - interaction.turn_index))
        return float(len(ctx["messages"]))

    class CtxLen(BaseScorer):
        name = "ctx_len"

        async def evaluate(self, interaction, ctx):
            return await per_turn(interaction, ctx)

    runner = runner_of(CtxLen())
    sessions = [make_turns(n, session_id=f"s{n}") for n in (1, 2, 3)]
    results = await asyncio.gather(*(score_session(runner, t) for t in sessions))
    for n, rewards in zip((1, 2, 3), results, strict=True):
        assert {v for r in rewards.values() for v in r} == {float(2 * n)}
