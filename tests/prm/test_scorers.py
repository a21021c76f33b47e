"""Built-in scorers: LengthBudgetScorer, and LLMJudgeScorer against a real judge server
process (``python -m judge_server.cli --backend rules``) over HTTP; faults (judge_failed, null score) are
injected with httpx.MockTransport, an unreachable judge with a closed port."""

from __future__ import annotations

import httpx
import pytest

from engine.http_client import RetryPolicy
from prm import PRMRejected, PRMRunner, score_session
from prm.scorers import LengthBudgetScorer, LLMJudgeScorer
from tests.prm.prm_test_scorers import make_turns
from tests.testkit.procs import free_port
from tests.testkit.servers import JUDGE_KEY, start_judge

JUDGE_PATH = "prm.scorers.LLMJudgeScorer"


@pytest.mark.unit
async def test_length_budget_scores_and_observations():
    runner = PRMRunner({"scorers": [LengthBudgetScorer(max_output_tokens=3)]})
    rewards = await score_session(runner, make_turns(3))  # output lengths 2, 3, 4
    assert rewards == {0: [1.0, 1.0], 1: [1.0, 1.0, 1.0], 2: [0.0] * 4}
    snap = runner.metrics.snapshot()
    assert snap["rollout/prm_metric/turn/length_budget/within_budget/rate"] == pytest.approx(2 / 3)


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_length_budget_rejects_bad_budget(bad):
    with pytest.raises(ValueError, match="max_output_tokens must be a positive int"):
        LengthBudgetScorer(max_output_tokens=bad)


@pytest.mark.unit
async def test_llm_judge_config_validation():
    with pytest.raises(ValueError, match="reward_range: unit"):
        await PRMRunner.create(
            {
                "advantage_shaping": {"mode": "process_weighted"},
                "scorers": [{"path": JUDGE_PATH, "kwargs": {"judge_url": "http://127.0.0.1:9"}}],
            }
        )
    with pytest.raises(ValueError, match="needs judge_url"):
        LLMJudgeScorer()
    with pytest.raises(ValueError, match="reward_range"):
        LLMJudgeScorer(judge_url="http://127.0.0.1:9", reward_range="percent")


def fault_client(prm: dict) -> object:
    from judge_server.client import JudgeClient

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"prm": prm, "usage": {}, "prompt_versions": {}})

    return JudgeClient(
        "http://judge.invalid", transport=httpx.MockTransport(handler), retry=RetryPolicy(max_attempts=1)
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "prm, match",
    [
        ({"score": None, "status": "judge_failed", "votes": [None], "reason": "engine down"}, "status='judge_failed'"),
        ({"score": None, "status": "no_valid_votes", "votes": [None, None]}, "status='no_valid_votes'"),
        ({"score": 1, "status": "judge_failed"}, "judge_failed"),
    ],
)
async def test_llm_judge_failures_reject_never_zero(prm, match):
    client = fault_client(prm)
    runner = PRMRunner({"scorers": [LLMJudgeScorer(client=client)]})
    with pytest.raises(PRMRejected, match=match):
        await score_session(runner, judged_turns(["thanks"]))
    await client.aclose()


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    args = ["--api-key", JUDGE_KEY, "--log-level", "warning"]
    proc = start_judge(tmp_path_factory.mktemp("judge"), "judge-rules", args=args)
    yield proc.url
    proc.stop()


def judged_turns(replies: list[str]) -> list[dict]:
    """One session; turn i's next state is the user's reply replies[i] (the last turn has an explicit one)."""
    turns = make_turns(len(replies))
    for i, text in enumerate(replies):
        turns[i]["next_state"] = [{"role": "user", "content": text}]
    return turns


@pytest.mark.e2e
async def test_llm_judge_over_http_with_length_budget(judge_url):
    config = {
        "prm": {
            "advantage_shaping": {"mode": "process_weighted"},
            "scorers": [
                {
                    "path": JUDGE_PATH,
                    "weight": 0.5,
                    "kwargs": {
                        "judge_url": judge_url,
                        "api_key": JUDGE_KEY,
                        "m": 3,
                        "reward_range": "unit",
                        "deadline_s": 20,
                    },
                },
                {
                    "path": "prm.scorers.LengthBudgetScorer",
                    "weight": 0.5,
                    "kwargs": {"max_output_tokens": 3},
                },
            ],
        },
        "actor": {"token_rewards_as_adv": True},
    }
    runner = await PRMRunner.create(config)
    try:
        turns = judged_turns(["thanks, that worked", "that's wrong", "ok next"])  # +1, -1, 0 by the rules judge
        rewards = await score_session(runner, turns)
        # 0.5 * judge in unit range + 0.5 * within-budget (lengths 2, 3, 4 vs budget 3)
        assert rewards == {0: [1.0] * 2, 1: [0.5] * 3, 2: [0.25] * 4}
        snap = runner.metrics.snapshot()
        assert snap["rollout/prm_metric/turn/llm_judge/judge_tie/rate"] == 0.0
        assert snap["rollout/prm_turn_reward/llm_judge"] == pytest.approx(0.5 * (1 + 0 + 0.5) / 3)
        judge = runner.scorers[0]
    finally:
        await runner.aclose()
    assert judge._client._http.is_closed  # the owned JudgeClient was closed by the runner


@pytest.mark.e2e
async def test_llm_judge_next_state_from_child_and_missing_next_state(judge_url):
    scorer = LLMJudgeScorer(judge_url=judge_url, api_key=JUDGE_KEY, m=1, deadline_s=20)
    runner = PRMRunner({"scorers": [scorer]})
    turns = make_turns(2)
    turns[1]["messages"][-1]["content"] = "No, redo it"  # the user's reply to turn 0, seen through turn 1
    with pytest.raises(PRMRejected, match="has no next state"):
        await score_session(runner, turns)  # leaf turn 1 was never answered
    turns[1]["next_state"] = [{"role": "user", "content": "great"}]
    assert await score_session(runner, turns) == {0: [-1.0, -1.0], 1: [1.0, 1.0, 1.0]}
    zero = LLMJudgeScorer(judge_url=judge_url, api_key=JUDGE_KEY, m=1, missing_next_state="zero", deadline_s=20)
    del turns[1]["next_state"]
    assert await score_session(PRMRunner({"scorers": [zero]}), turns) == {0: [-1.0, -1.0], 1: [0.0, 0.0, 0.0]}
    await scorer.aclose()
    await zero.aclose()


@pytest.mark.e2e
async def test_llm_judge_unreachable_or_unauthorized_rejects(judge_url):
    dead = LLMJudgeScorer(judge_url=f"http://127.0.0.1:{free_port()}", deadline_s=0.5)
    with pytest.raises(PRMRejected, match="JudgeUnavailable"):
        await score_session(PRMRunner({"scorers": [dead]}), judged_turns(["thanks"]))
    await dead.aclose()
    wrong_key = LLMJudgeScorer(judge_url=judge_url, api_key="wrong", deadline_s=5)
    with pytest.raises(PRMRejected, match="JudgeRequestRejected"):
        await score_session(PRMRunner({"scorers": [wrong_key]}), judged_turns(["thanks"]))
    await wrong_key.aclose()
