"""The schema of record (engine/records.py) reproduces the JSON the services exchange, byte for byte.

Contract: every literal below is what the producers wrote before the records existed (the reward
pipeline's sample fields, then the dispatcher's turn fields and origin; the judge's per-task verdicts; the
policy server's turn record). ``Model.model_validate(d).to_json()`` must give back ``d`` with the same
keys in the same order, the same nulls and the same absent keys, so ``json.dumps`` is byte-identical.
"""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from engine.records import (
    SAMPLE_ORIGIN_KEYS,
    SAMPLE_STATUSES,
    SAMPLE_TURN_KEYS,
    SCORING_TURN_KEYS,
    STATUS_FAILED,
    GuardHit,
    HintVerdict,
    JudgeUsage,
    JudgeVerdicts,
    PipelineOutcome,
    PrmVerdict,
    RejectReason,
    Sample,
    SampleState,
    TeacherTopK,
    Turn,
    TurnRecord,
)
from policy_server.rewards.dispatch import _sample_json
from policy_server.rewards.modes import ModeSnapshot, build_sample
from policy_server.rewards.scoring import ScoreOutcome, apply_outcome

pytestmark = pytest.mark.unit

PRM_OK = {
    "score": 1,
    "status": "ok",
    "votes": [1, 1, None],
    "confidence": 1.0,
    "reason": None,
    "engine_calls": 2,
    "prompt_tokens": 2410,
    "cached_tokens": 1150,
    "completion_tokens": 96,
}
HINT_OK = {
    "accepted": True,
    "hint": "check the path first",
    "votes": [1, -1],
    "status": "ok",
    "reason": None,
    "vote_status": "tie",
    "engine_calls": 1,
    "prompt_tokens": 1230,
    "cached_tokens": 1150,
    "completion_tokens": 80,
}
HINT_FAILED = {
    "accepted": False,
    "hint": None,
    "votes": [],
    "status": "judge_failed",
    "reason": "engine unavailable",
    "vote_status": "judge_failed",
    "engine_calls": 0,
    "prompt_tokens": 0,
    "cached_tokens": 0,
    "completion_tokens": 0,
}
TURN = {
    "chat_template_kwargs": None,
    "messages": [{"role": "user", "content": "hi"}],
    "tools": None,
    "prompt_ids": [1, 2, 3],
    "response_ids": [4, 5, 6],
    "rollout_logprobs": [-0.1, -0.2, -0.3],
    "response": {"content": "hello", "reasoning_content": None, "tool_calls": None},
    "weight_version": "3",
    "weight_versions": ["3"],
    "sampling_params": {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 64},
    "constrained": False,
    "response_id": "chatcmpl-0123",
    "session_rule": "prompt_cache_key",
    "session_decision": "continued",
    "session_id": "s1",
    "turn_index": 2,
    "created_at": 1764556800.25,
    "pairing": "paired",
    "pairing_note": None,
    "next_state": [{"role": "user", "content": "thanks"}],
    "session_done": False,
}
TURN_PART = {
    "prompt_ids": [1, 2, 3],
    "response_ids": [4, 5, 6],
    "rollout_logprobs": [-0.1, -0.2, -0.3],
    "weight_version": "3",
    "weight_versions": ["3"],
    "sampling_params": {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 64},
}
ORIGIN = {"sample_id": "smp-1", "session_id": "s1", "turn_index": 2, "created_at": 1764556800.25, "constrained": False}


def _old_sample(
    mode: str,
    *,
    include: bool,
    reward: float | None,
    prm: dict | None,
    hint: dict | None,
    teacher: list[float] | None = None,
    topk: dict | None = None,
    token_rewards: list[float] | None = None,
    versions: dict | None = None,
) -> dict:
    """A Sample exactly as the dispatcher wrote it: pipeline fields, prompt_versions, turn fields, origin."""
    return {
        "mode": mode,
        "loss_mask": [1 if include else 0] * 3,
        "reward": reward,
        "has_reward": reward is not None,
        "has_teacher": teacher is not None,
        "prm": prm,
        "hint": hint,
        "teacher_logprobs": teacher,
        "teacher_topk": topk,
        "token_rewards": token_rewards,
        "w_rl": 1.0,
        "w_opd": 0.5,
        "prompt_versions": versions or {},
        **TURN_PART,
        **ORIGIN,
    }


TEACHER = [-0.5, -1.25, -0.01]
TOPK = {"ids": [[5, 9], [6, 1], [7, 2]], "logprobs": [[-0.5, -2.0], [-1.25, -1.5], [-0.01, -5.0]]}
VERSIONS = {"prm": "prm_eval_v2@abc", "hint": "hint_extract_v2@def", "teacher_hint": "teacher_hint_v1@123"}
OLD_SAMPLES = {
    "rl": _old_sample("rl", include=True, reward=1.0, prm=PRM_OK, hint=None, versions={"prm": "prm_eval_v2@abc"}),
    "rl_prm_token_rewards": _old_sample(
        "rl", include=True, reward=-1.0, prm={**PRM_OK, "score": -1}, hint=None, token_rewards=[0.5, -0.25, 1.0]
    ),
    "rl_promoted_tie": _old_sample(
        "rl", include=True, reward=0.0, hint=None, prm={**PRM_OK, "score": 0, "status": "tie", "confidence": 0.5}
    ),
    "rl_rejected_no_valid": _old_sample(
        "rl",
        include=False,
        reward=None,
        hint=None,
        prm={**PRM_OK, "score": 0, "status": "no_valid_votes", "votes": [None]},
    ),
    "opd": _old_sample(
        "opd",
        include=True,
        reward=None,
        prm=None,
        hint=HINT_OK,
        teacher=TEACHER,
        topk=TOPK,
        versions={"hint": "hint_extract_v2@def", "teacher_hint": "teacher_hint_v1@123"},
    ),
    "opd_no_topk": _old_sample("opd", include=True, reward=None, prm=None, hint=HINT_OK, teacher=TEACHER),
    "combine": _old_sample(
        "combine",
        include=True,
        reward=1.0,
        prm=PRM_OK,
        hint=HINT_OK,
        teacher=TEACHER,
        versions=VERSIONS,
        token_rewards=[0.1, 0.2, 0.3],
    ),
    "combine_hint_failed": _old_sample(
        "combine", include=False, reward=None, prm=PRM_OK, hint=HINT_FAILED, versions=VERSIONS
    ),
    "prm_rejected": {**_old_sample("rl", include=False, reward=1.0, prm=PRM_OK, hint=None)},
    "pipeline_error": {**TURN_PART, **ORIGIN},  # a pipeline exception: no mode fields at all
    "rejected_before_judging": _old_sample("opd", include=False, reward=None, prm=None, hint=None),
}


@pytest.mark.parametrize("name", sorted(OLD_SAMPLES))
def test_sample_round_trips_todays_json_byte_for_byte(name):
    old = OLD_SAMPLES[name]
    got = Sample.model_validate(old).to_json()
    assert got == old
    assert list(got) == list(old)
    assert json.dumps(got, ensure_ascii=False) == json.dumps(old, ensure_ascii=False)


@pytest.mark.parametrize(
    "mode, prm, hint, reward, teacher, topk",
    [
        ("rl", PRM_OK, None, 1.0, None, None),
        ("opd", None, HINT_OK, None, TEACHER, TOPK),
        ("combine", PRM_OK, HINT_OK, 1.0, TEACHER, None),
    ],
)
def test_dispatcher_builds_the_same_sample_as_before(mode, prm, hint, reward, teacher, topk):
    fields = build_sample(
        ModeSnapshot(mode=mode, w_rl=1.0, w_opd=0.5),
        3,
        include=True,
        prm=None if prm is None else PrmVerdict.model_validate(prm),
        hint=None if hint is None else HintVerdict.model_validate(hint),
        reward=reward,
        teacher_logprobs=teacher,
        teacher_topk=None if topk is None else TeacherTopK.model_validate(topk),
        prompt_versions=dict(VERSIONS),
    ).to_json()
    # The old composition: the pipeline's dict, updated with the turn's fields and the origin.
    old = dict(fields)
    old.update(TURN_PART)
    old.update(ORIGIN)
    new = Sample.model_validate(_sample_json(fields, Turn.model_validate(TURN), "smp-1")).to_json()
    assert json.dumps(new) == json.dumps(old)


def test_prm_outcome_folded_in_keeps_the_order():
    result = PipelineOutcome.ready(Sample.model_validate(OLD_SAMPLES["rl"]))
    scored = apply_outcome(result, ScoreOutcome("scored", token_rewards=[0.5, 0.5, 0.5])).sample.to_json()
    rejected = apply_outcome(result, ScoreOutcome("rejected", reason="prm_rejected: veto")).sample.to_json()
    # The old composition updated the stored dict in place: every key keeps its place.
    assert json.dumps(scored) == json.dumps({**OLD_SAMPLES["rl"], "token_rewards": [0.5, 0.5, 0.5]})
    assert json.dumps(rejected) == json.dumps({**OLD_SAMPLES["rl"], "token_rewards": None, "loss_mask": [0, 0, 0]})
    assert result.sample.to_json() == OLD_SAMPLES["rl"]  # the outcome's own sample is not modified


def test_non_finite_values_survive_for_the_value_checks():
    """A NaN reward is written as NaN (never null), so it is rejected ``invalid_values``, not dropped."""
    bad = {**OLD_SAMPLES["rl"], "reward": math.nan, "token_rewards": [0.1, math.inf, 0.0]}
    s = Sample.model_validate(bad)
    assert math.isnan(s.to_json()["reward"]) and s.to_json()["token_rewards"][1] == math.inf
    assert s.value_problem() == "reward is not a finite number (nan)"
    assert Sample.model_validate({**bad, "reward": 1.0}).value_problem() == (
        "token_rewards holds a non-finite or non-numeric value (inf)"
    )
    assert Sample.model_validate(OLD_SAMPLES["opd"]).value_problem() is None
    positive = {**OLD_SAMPLES["opd"], "teacher_logprobs": [-0.1, 0.5, -0.2]}
    assert Sample.model_validate(positive).value_problem() == "teacher_logprobs holds a positive log-probability (0.5)"


def test_sample_values_are_not_coerced():
    with pytest.raises(ValidationError):
        Sample.model_validate({**OLD_SAMPLES["rl"], "reward": "1"})
    with pytest.raises(ValidationError):
        Sample.model_validate({**OLD_SAMPLES["rl"], "mode": "rlhf"})
    assert Sample.model_validate({**OLD_SAMPLES["rl"], "future_field": [1]}).to_json()["future_field"] == [1]


def test_verdicts_are_typed_and_keep_the_judges_order():
    prm = PrmVerdict.model_validate(PRM_OK)
    assert (prm.score, prm.status, prm.engine_calls) == (1, "ok", 2)
    assert list(prm.to_json()) == list(PRM_OK)
    usage = JudgeUsage(engine_calls=1, prompt_tokens=1230, cached_tokens=1150, completion_tokens=80)
    wired = HintVerdict.wire(
        accepted=True,
        hint="check the path first",
        votes=[1, -1],
        status="ok",
        reason=None,
        vote_status="tie",
        usage=usage,
    )
    assert json.dumps(wired.to_json()) == json.dumps(HINT_OK)
    usage = JudgeUsage(engine_calls=2, prompt_tokens=2410, cached_tokens=1150, completion_tokens=96)
    wired_prm = PrmVerdict.wire(score=1, status="ok", votes=[1, 1, None], confidence=1.0, reason=None, usage=usage)
    # The judge writes the guard hits (none here) after the vote fields, before the cost fields.
    keys = list(PRM_OK)
    guarded = dict([*((k, PRM_OK[k]) for k in keys[:5]), ("guards", []), *((k, PRM_OK[k]) for k in keys[5:])])
    assert json.dumps(wired_prm.to_json()) == json.dumps(guarded)
    hit = GuardHit(rule="degenerate", action="quarantine", detail="empty reply")
    ruled = PrmVerdict.wire(
        score=None, status="quarantined", votes=[1], confidence=0.0, reason="guard", usage=usage, guards=[hit]
    )
    assert ruled.to_json()["guards"] == [{"rule": "degenerate", "action": "quarantine", "detail": "empty reply"}]
    assert PrmVerdict.model_validate(ruled.to_json()).guards == [hit]
    answer = {
        "prm": PRM_OK,
        "hint": HINT_FAILED,
        "usage": {"engine_calls": 2, "prompt_tokens": 2410, "cached_tokens": 1150, "completion_tokens": 96},
        "prompt_versions": {"prm": "prm_eval_v2@abc", "hint": "hint_extract_v2@def"},
    }
    parsed = JudgeVerdicts.model_validate(answer)
    assert parsed.hint is not None and parsed.hint.status == STATUS_FAILED and parsed.hint.hint is None
    assert json.dumps(parsed.to_json()) == json.dumps(answer)
    with pytest.raises(ValidationError):
        PrmVerdict.model_validate({**PRM_OK, "status": "maybe"})


def test_a_verdict_off_the_schema_is_kept_as_given_in_the_sample():
    odd = {"score": 0.5, "status": "weird"}
    s = Sample.model_validate({**OLD_SAMPLES["rl_rejected_no_valid"], "prm": odd})
    assert s.prm == odd and s.to_json()["prm"] == odd


def test_turn_record_and_stored_turn_round_trip():
    record = {k: TURN[k] for k in TurnRecord.model_fields}
    assert json.dumps(TurnRecord.model_validate(record).to_json()) == json.dumps(record)
    assert json.dumps(Turn.model_validate(TURN).to_json()) == json.dumps(TURN)
    older = {
        k: v
        for k, v in record.items()
        if k not in ("chat_template_kwargs", "constrained", "session_rule", "session_decision")
    }
    assert TurnRecord.model_validate(older).to_json() == older  # a record written before those fields


def test_statuses_and_reasons_are_the_stored_strings():
    assert SAMPLE_STATUSES == ("pending_judge", "pending_score", "ready", "leased", "consumed", "rejected")
    assert RejectReason.with_detail(RejectReason.INVALID_VALUES, "x") == "invalid_values: x"
    assert RejectReason.CLIENT_DISCONNECTED == "client_disconnected"
    names = {k: v for k, v in vars(SampleState).items() if k.isupper()}
    assert names == {
        "PENDING_JUDGE": "pending_judge",
        "PENDING_SCORE": "pending_score",
        "READY": "ready",
        "LEASED": "leased",
        "CONSUMED": "consumed",
        "REJECTED": "rejected",
    }


def test_sample_fields_are_the_pipelines_then_the_turns_then_the_origin():
    pipeline = (
        "mode",
        "loss_mask",
        "reward",
        "has_reward",
        "has_teacher",
        "prm",
        "hint",
        "teacher_logprobs",
        "teacher_topk",
        "teacher_temperature",
        "token_rewards",
        "w_rl",
        "w_opd",
        "prompt_versions",
    )
    # "rolled_back": set at lease time when the version that made it was rolled back (docs/SAFE_UPDATES.md)
    assert tuple(Sample.model_fields) == pipeline + SAMPLE_TURN_KEYS + SAMPLE_ORIGIN_KEYS + ("feedback", "rolled_back")
    assert {
        "session_id",
        "turn_index",
        "messages",
        "response",
        "prompt_ids",
        "response_ids",
        "parent_turn_index",
        "next_state",
    } == SCORING_TURN_KEYS


def test_pipeline_outcome_is_typed():
    ready = PipelineOutcome.ready(Sample(mode="rl"), {"prm": "v1"})
    assert (ready.status, ready.reject_reason, ready.included) == ("ready", None, True)
    held = ready.held()
    assert (held.status, held.included, held.sample.to_json(), held.prompt_versions) == (
        "pending_score",
        True,
        {"mode": "rl"},
        {"prm": "v1"},
    )
    rejected = PipelineOutcome.rejected("no_hint")
    assert (rejected.status, rejected.reject_reason, rejected.included, rejected.sample.to_json()) == (
        "rejected",
        "no_hint",
        False,
        {},
    )
    with pytest.raises(ValidationError):
        PipelineOutcome(status="done")
