"""RewardPipeline against a real judge server (rules backend) and a real teacher dev engine.

Contract checked (docs/REWARD_MODES.md): exact sample contents per mode and verdict; the teacher
log-probs have one entry per response id, the first one real, and equal a torch recomputation with the
teacher checkpoint on the hint-augmented prompt (1e-4), top-K rows included; at-least-one promotes only
neutral verdicts of a session without an included sample; judge failures are rejected with the reason.
The rules judge: "thanks" -> +1 (no hint), "wrong"/"No," -> -1 with the next-state text as the hint,
anything else -> 0 (no hint).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.chat import render_prompt_ids
from engine.client import EngineClient
from engine.records import PipelineTurn
from judge_server.client import JUDGE_RETRY, JudgeClient
from policy_server.rewards.modes import RewardPipeline
from policy_server.settings import PolicySettings
from tests.numerics import logprob_atol

# The teacher reads the policy's prompt plus the hint: a bound on the positions that adds for the tolerance
# (it enters under a square root, so a generous bound costs little).
HINT_POSITIONS = 256

pytestmark = pytest.mark.e2e

POSITIVE = [{"role": "user", "content": "Thanks, that worked."}]
NEGATIVE = [{"role": "user", "content": "No, that is wrong. Use the other file in /tmp."}]
NEUTRAL = [{"role": "user", "content": "Now list the folder."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(policy_tokenizer):
    return policy_tokenizer


@pytest.fixture(scope="module")
def turn(tokenizer):
    messages = [
        {"role": "system", "content": "You help with files."},
        {"role": "user", "content": "Open the report file."},
    ]
    response_text = "Here is the report file from your home folder."
    response_ids = tokenizer.encode(response_text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return PipelineTurn(
        session_id="sess",
        turn_index=0,
        messages=messages,
        tools=TOOLS,
        prompt_ids=render_prompt_ids(tokenizer, messages, TOOLS),
        response_ids=response_ids,
        rollout_logprobs=[-1.0] * len(response_ids),
        response={"content": response_text, "reasoning_content": None, "tool_calls": []},
        weight_version="0",
        weight_versions=["0"],
        sampling_params={"temperature": 1.0},
    )


@pytest.fixture
async def make_pipeline():
    """Factory of pipelines with a real JudgeClient (+ teacher EngineClient); clients closed after the test."""
    clients = []

    def make(judge_url, teacher_url, tokenizer, mode, **extra):
        fields = {
            "mode": mode,
            "w_rl": 1.0,
            "w_opd": 0.5,
            "judge_m": 3,
            "at_least_one": True,
            "teacher_top_k": 0,
            "teacher_temperature": 1.0,
        }
        settings = PolicySettings.model_construct(**{**fields, **extra})
        judge = JudgeClient(judge_url, retry=replace(JUDGE_RETRY, deadline_s=30.0))
        teacher = EngineClient(teacher_url) if teacher_url else None
        clients.extend(c for c in (judge, teacher) if c is not None)
        return RewardPipeline(judge=judge, teacher=teacher, tokenizer=tokenizer, settings=settings)

    yield make
    for c in clients:
        await c.aclose()


async def test_rl_samples(rules_judge, tokenizer, turn, make_pipeline):
    pipe = make_pipeline(rules_judge.url, None, tokenizer, "rl")
    n = len(turn.response_ids)
    pos = await pipe.process(turn, POSITIVE, session_has_included=True, session_done=False)
    assert (pos.status, pos.included, pos.reject_reason) == ("ready", True, None)
    s = pos.sample.to_json()
    assert (s["mode"], s["reward"], s["has_reward"], s["has_teacher"]) == ("rl", 1.0, True, False)
    assert s["loss_mask"] == [1] * n and s["teacher_logprobs"] is None and s["hint"] is None
    assert "teacher_temperature" not in s  # no teacher term, no temperature
    assert s["prm"]["status"] == "ok" and s["prm"]["votes"] == [1, 1, 1]
    assert pos.prompt_versions["prm"].startswith("rules@")

    neg = await pipe.process(turn, NEGATIVE, session_has_included=True, session_done=False)
    assert (neg.status, neg.sample.reward, neg.sample.loss_mask) == ("ready", -1.0, [1] * n)

    neutral = await pipe.process(turn, NEUTRAL, session_has_included=True, session_done=False)
    assert (neutral.status, neutral.reject_reason, neutral.included) == ("rejected", "prm_neutral", False)
    assert neutral.sample.loss_mask == [0] * n and neutral.sample.has_reward is False
    assert neutral.sample.prm.score == 0  # the verdict is kept for audit


@pytest.mark.parametrize("top_k", [0, 4])
async def test_opd_teacher_logprobs_match_torch(
    rules_judge, teacher_engine, tokenizer, teacher_logprobs_torch, teacher_model_dir, turn, top_k, make_pipeline
):
    pipe = make_pipeline(rules_judge.url, teacher_engine.url, tokenizer, "opd", teacher_top_k=top_k)
    out = await pipe.process(turn, NEGATIVE, session_has_included=True, session_done=False)
    assert (out.status, out.included) == ("ready", True), out.reject_reason
    s = out.sample.to_json()
    n = len(turn.response_ids)
    hint = NEGATIVE[0]["content"]
    assert s["hint"]["accepted"] is True and s["hint"]["hint"] == hint
    assert (s["mode"], s["has_teacher"], s["has_reward"], s["reward"], s["loss_mask"]) == (
        "opd",
        True,
        False,
        None,
        [1] * n,
    )
    assert out.prompt_versions["teacher_hint"].startswith("teacher_hint_v1@")
    assert s["teacher_temperature"] == 1.0  # recorded with the log-probs it produced
    expected, top = teacher_logprobs_torch(turn.messages, turn.tools, turn.response_ids, hint, top_k)
    assert len(s["teacher_logprobs"]) == n
    assert s["teacher_logprobs"][0] < 0  # the first response token is scored, not a 0.0 placeholder
    atol = logprob_atol(teacher_model_dir, len(turn.prompt_ids) + n + HINT_POSITIONS, expected)
    assert s["teacher_logprobs"] == pytest.approx(expected, abs=atol)
    if top_k:
        assert len(s["teacher_topk"]["ids"]) == n and all(len(r) == top_k for r in s["teacher_topk"]["ids"])
        tops = top.values.tolist()
        top_atol = logprob_atol(teacher_model_dir, len(turn.prompt_ids) + n + HINT_POSITIONS, sum(tops, []))
        for got, want in zip(s["teacher_topk"]["logprobs"], tops, strict=True):
            assert got == pytest.approx(want, abs=top_atol)
        # ids may swap only between (near-)equal log-probs; check each id's log-prob instead of the order
        assert all(set(r) == set(e) for r, e in zip(s["teacher_topk"]["ids"], top.indices.tolist(), strict=True))
    else:
        assert s["teacher_topk"] is None


async def test_opd_without_hint_is_rejected(rules_judge, teacher_engine, tokenizer, turn, make_pipeline):
    pipe = make_pipeline(rules_judge.url, teacher_engine.url, tokenizer, "opd")
    for state in (POSITIVE, NEUTRAL):
        out = await pipe.process(turn, state, session_has_included=False, session_done=False)
        assert (out.status, out.reject_reason, out.included) == ("rejected", "no_hint", False)
        assert out.sample.teacher_logprobs is None and out.sample.hint.accepted is False


async def test_combine_samples(
    rules_judge, teacher_engine, tokenizer, teacher_logprobs_torch, teacher_model_dir, turn, make_pipeline
):
    pipe = make_pipeline(rules_judge.url, teacher_engine.url, tokenizer, "combine")
    n = len(turn.response_ids)
    both = await pipe.process(turn, NEGATIVE, session_has_included=True, session_done=False)
    s = both.sample.to_json()
    assert both.status == "ready"
    assert (s["mode"], s["reward"], s["has_reward"], s["has_teacher"], s["w_rl"], s["w_opd"]) == (
        "combine",
        -1.0,
        True,
        True,
        1.0,
        0.5,
    )
    expected, _ = teacher_logprobs_torch(turn.messages, turn.tools, turn.response_ids, NEGATIVE[0]["content"])
    n_positions = len(turn.prompt_ids) + len(expected) + HINT_POSITIONS
    assert s["teacher_logprobs"] == pytest.approx(expected, abs=logprob_atol(teacher_model_dir, n_positions, expected))

    rl_only = await pipe.process(turn, POSITIVE, session_has_included=True, session_done=False)
    s = rl_only.sample.to_json()
    assert rl_only.status == "ready" and s["loss_mask"] == [1] * n
    assert (s["reward"], s["has_reward"], s["has_teacher"], s["teacher_logprobs"]) == (1.0, True, False, None)
    assert s["teacher_logprobs"] != turn.rollout_logprobs  # never "teacher = rollout"

    neither = await pipe.process(turn, NEUTRAL, session_has_included=True, session_done=False)
    assert (neither.status, neither.reject_reason) == ("rejected", "no_signal: prm_neutral, no_hint")
    promoted = await pipe.process(turn, NEUTRAL, session_has_included=False, session_done=False)
    s = promoted.sample.to_json()
    assert promoted.status == "ready" and s["loss_mask"] == [1] * n
    assert (s["reward"], s["has_reward"], s["has_teacher"]) == (0.0, True, False)


async def test_at_least_one_promotes_neutral_only(rules_judge, tokenizer, turn, make_pipeline):
    pipe = make_pipeline(rules_judge.url, None, tokenizer, "rl")
    out = await pipe.process(turn, NEUTRAL, session_has_included=False, session_done=False)
    s = out.sample.to_json()
    assert (out.status, out.included, s["reward"], s["has_reward"]) == ("ready", True, 0.0, True)
    assert s["loss_mask"] == [1] * len(turn.response_ids)
    off = make_pipeline(rules_judge.url, None, tokenizer, "rl")
    off.at_least_one = False
    out = await off.process(turn, NEUTRAL, session_has_included=False, session_done=False)
    assert (out.status, out.reject_reason) == ("rejected", "prm_neutral")


async def test_judge_failures_are_rejected_never_promoted(broken_judge, teacher_engine, tokenizer, turn, make_pipeline):
    for mode in ("rl", "combine"):
        pipe = make_pipeline(broken_judge.url, teacher_engine.url, tokenizer, mode)
        out = await pipe.process(turn, NEUTRAL, session_has_included=False, session_done=False)
        assert out.status == "rejected" and out.included is False
        assert out.reject_reason.startswith("judge_failed: prm:"), out.reject_reason
        assert out.sample.loss_mask == [0] * len(turn.response_ids)
        assert out.sample.prm.status == "judge_failed" and out.sample.reward is None
