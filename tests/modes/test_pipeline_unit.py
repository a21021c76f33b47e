"""Unit tests of RewardPipeline.process routing (no sockets): which judge tasks each mode asks for,
what is rejected before any judge call, and how judge-service errors surface.

Contract: rl asks ["prm"], opd ["hint"], combine ["prm", "hint"] in one call with the configured m;
no next state / empty response are rejected without a judge call; opd/combine without a teacher are
rejected ``no_teacher``; JudgeUnavailable propagates (the dispatcher keeps the turn pending), a 4xx
from the judge is a stored ``judge_rejected``. The judge here is a recording in-process double of
JudgeClient's ``judge`` method; verdict-driven behaviour is tested end to end in test_modes_e2e.py.
"""

from __future__ import annotations

import pytest

from engine.records import JudgeVerdicts, PipelineTurn
from judge_server.errors import JudgeBadResponse, JudgeRequestRejected, JudgeUnavailable
from policy_server.rewards.modes import ModeState, RewardPipeline
from policy_server.settings import PolicySettings

pytestmark = pytest.mark.unit

TURN = PipelineTurn(
    session_id="s1",
    turn_index=0,
    messages=[{"role": "user", "content": "hi"}],
    tools=None,
    prompt_ids=[1, 2, 3],
    response_ids=[4, 5, 6],
    rollout_logprobs=[-0.1, -0.2, -0.3],
    response={"content": "hello", "reasoning_content": None, "tool_calls": []},
)
NEXT = [{"role": "user", "content": "thanks"}]


class RecordingJudge:
    def __init__(self, answer=None, raises=None):
        self.calls = []
        self.tools = []  # the offered tools of each call (for the judge's guards)
        self.answer = answer
        self.raises = raises

    async def judge(self, context, response, next_state, tasks, m=None, *, tools=None):
        self.tools.append(tools)
        self.calls.append(
            {"context": context, "response": response, "next_state": next_state, "tasks": list(tasks), "m": m}
        )
        if self.raises:
            raise self.raises
        return JudgeVerdicts.model_validate(self.answer)


def pipeline(judge, mode="rl", teacher=None, **settings):
    s = PolicySettings.model_construct(mode=mode, w_rl=0.5, w_opd=2.0, judge_m=5, **settings)
    return RewardPipeline(judge=judge, teacher=teacher, tokenizer=None, settings=s)


OK_PRM = {
    "prm": {
        "score": 1,
        "status": "ok",
        "votes": [1] * 5,
        "confidence": 1.0,
        "reason": None,
        "engine_calls": 2,
        "prompt_tokens": 900,
        "cached_tokens": 400,
        "completion_tokens": 60,
    },
    "prompt_versions": {"prm": "prm_eval_v1@abc"},
}


async def test_rl_asks_prm_with_m_and_passes_turn_through():
    judge = RecordingJudge(OK_PRM)
    out = await pipeline(judge).process(TURN, NEXT, session_has_included=False, session_done=False)
    assert judge.calls == [
        {"context": TURN.messages, "response": TURN.response, "next_state": NEXT, "tasks": ["prm"], "m": 5}
    ]
    assert out.status == "ready" and out.included and out.reject_reason is None
    s = out.sample.to_json()
    assert (s["mode"], s["reward"], s["has_reward"], s["has_teacher"], s["loss_mask"]) == (
        "rl",
        1.0,
        True,
        False,
        [1, 1, 1],
    )
    assert (s["w_rl"], s["w_opd"], s["teacher_logprobs"], s["teacher_topk"]) == (0.5, 2.0, None, None)
    assert out.prompt_versions == s["prompt_versions"] == {"prm": "prm_eval_v1@abc"}
    assert s["prm"] == OK_PRM["prm"]  # the judge's verdict, cost fields included, reaches the sample unchanged


@pytest.mark.parametrize("next_state", [None, []])
async def test_no_next_state_is_rejected_without_judging(next_state):
    judge = RecordingJudge(OK_PRM)
    for mode in ("rl", "opd", "combine"):
        out = await pipeline(judge, mode, teacher=object.__new__(object)).process(
            TURN, next_state, session_has_included=False, session_done=True
        )
        assert (out.status, out.reject_reason, out.included) == ("rejected", "no_next_state", False)
        assert out.sample.loss_mask == [0, 0, 0] and out.sample.mode == mode
    assert judge.calls == []


async def test_empty_response_is_rejected_without_judging():
    judge = RecordingJudge(OK_PRM)
    out = await pipeline(judge).process(
        TURN.model_copy(update={"response_ids": []}), NEXT, session_has_included=False, session_done=False
    )
    assert (out.status, out.reject_reason) == ("rejected", "empty_response")
    assert judge.calls == []


@pytest.mark.parametrize("mode", ["opd", "combine"])
async def test_opd_and_combine_need_a_teacher(mode):
    judge = RecordingJudge(OK_PRM)
    out = await pipeline(judge, mode).process(TURN, NEXT, session_has_included=False, session_done=False)
    assert out.status == "rejected" and out.reject_reason.startswith("no_teacher")
    assert judge.calls == []


async def test_judge_unavailable_defers_and_4xx_rejects():
    with pytest.raises(JudgeUnavailable):  # propagates: the dispatcher keeps the turn pending and retries
        await pipeline(RecordingJudge(raises=JudgeUnavailable("connection refused"))).process(
            TURN, NEXT, session_has_included=False, session_done=False
        )
    out = await pipeline(RecordingJudge(raises=JudgeRequestRejected("context too large", 413))).process(
        TURN, NEXT, session_has_included=False, session_done=False
    )
    assert (out.status, out.reject_reason) == ("rejected", "judge_rejected: context too large")


async def test_mode_switch_applies_to_the_next_turn():
    judge = RecordingJudge(OK_PRM)
    state = ModeState("rl")
    pipe = RewardPipeline(
        judge=judge,
        teacher=None,
        tokenizer=None,
        settings=PolicySettings.model_construct(judge_m=None),
        mode_state=state,
    )
    assert (await pipe.process(TURN, NEXT, session_has_included=True, session_done=False)).sample.mode == "rl"
    state.set("combine", w_rl=0.25)
    out = await pipe.process(TURN, NEXT, session_has_included=True, session_done=False)
    assert out.reject_reason.startswith("no_teacher") and out.sample.mode == "combine"
    assert out.sample.w_rl == 0.25


async def test_judge_answer_off_the_schema_is_a_failed_judgement_not_a_score():
    judge = RecordingJudge(raises=JudgeBadResponse("judge answer off the JudgeVerdicts schema: prm.score: bad"))
    out = await pipeline(judge).process(TURN, NEXT, session_has_included=False, session_done=False)
    assert out.status == "rejected" and not out.included
    assert out.reject_reason == "judge_failed: judge answer off the JudgeVerdicts schema: prm.score: bad"
    assert out.sample.reward is None


async def test_the_turns_tools_and_finish_reason_reach_the_judge():
    """The judge's guards read the offered tools and the reply's finish reason: both travel with the call."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    turn = TURN.model_copy(update={"tools": tools, "response": {**TURN.response, "finish_reason": "length"}})
    judge = RecordingJudge(OK_PRM)
    await pipeline(judge).process(turn, NEXT, session_has_included=False, session_done=False)
    assert judge.tools == [tools]
    assert judge.calls[0]["response"]["finish_reason"] == "length"


async def test_a_quarantine_in_the_answer_rejects_the_turn_degenerate():
    hit = {"rule": "truncated", "action": "quarantine", "detail": "cut by its length limit (finish_reason=length)"}
    answer = {**OK_PRM, "guards": [hit]}
    out = await pipeline(RecordingJudge(answer)).process(TURN, NEXT, session_has_included=False, session_done=False)
    assert (out.status, out.included) == ("rejected", False)
    assert out.reject_reason == "degenerate: truncated: cut by its length limit (finish_reason=length)"
    assert out.sample.loss_mask == [0, 0, 0] and out.sample.prm is not None  # the verdict kept for audit
