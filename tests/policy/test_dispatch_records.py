"""The dispatcher stores each judged turn as an engine.records.Sample, and refuses a pipeline result off it.

Contract (policy_server.rewards.dispatch): the stored Sample JSON is the pipeline's fields, then the turn's
fields, then the origin, exactly what ``Sample.to_json()`` gives; a result whose number is unusable is
rejected by the store's value check (``invalid_values: ...``, like any other sample); any other
departure from the schema is rejected ``pipeline_error: sample off the schema: <field>: ...``, keeping
only the turn's fields, never stored as a trainable sample. The pipeline here is an in-process double
of RewardPipeline.process; the store is real (SQLite, or PostgreSQL when the suite runs on it).
"""

from __future__ import annotations

import math

import pytest

from engine.records import PipelineOutcome, PrmVerdict, Sample, TurnRecord
from policy_server.rewards.dispatch import Dispatcher
from policy_server.rewards.modes import ModeSnapshot, build_sample
from policy_server.store.records import SampleRow

pytestmark = pytest.mark.unit

RECORD = {
    "messages": [{"role": "user", "content": "hi"}],
    "tools": None,
    "prompt_ids": [1, 2],
    "response_ids": [3, 4],
    "rollout_logprobs": [-0.5, -0.25],
    "response": {"content": "ok", "reasoning_content": None, "tool_calls": None},
    "weight_version": "7",
    "weight_versions": ["7"],
    "sampling_params": {"temperature": 1.0, "top_p": 1.0},
    "constrained": False,
}
PRM = {
    "score": 1,
    "status": "ok",
    "votes": [1, 1, 1],
    "confidence": 1.0,
    "reason": None,
    "engine_calls": 1,
    "prompt_tokens": 10,
    "cached_tokens": 0,
    "completion_tokens": 3,
}


class FixedPipeline:
    """Answers every turn with the same result (what RewardPipeline.process returns)."""

    def __init__(self, sample: dict):
        self.sample = sample

    async def process(self, turn, next_state, *, session_has_included, session_done):
        return PipelineOutcome.ready(Sample.model_validate(self.sample))


def _dispatcher(store, fields: dict) -> Dispatcher:
    return Dispatcher(store, FixedPipeline(fields), concurrency=1, retry_initial_s=0.5, retry_max_s=30.0, claim_s=30.0)


def _good_fields() -> dict:
    fields = build_sample(
        ModeSnapshot(mode="rl", w_rl=1.0, w_opd=1.0),
        2,
        include=True,
        prm=PrmVerdict.model_validate(PRM),
        hint=None,
        reward=1.0,
        teacher_logprobs=None,
        teacher_topk=None,
        prompt_versions={"prm": "prm_eval_v2@abc"},
    )
    return fields.to_json()


@pytest.fixture
def store(store_factory):
    return store_factory()


def _row(store, turn_index: int) -> SampleRow:
    return next(r for r in store.list_samples(session_id="s", status=None, limit=10) if r.turn_index == turn_index)


async def _process_last_turn(store, fields: dict) -> SampleRow:
    store.record_turn(
        "s", TurnRecord.model_validate(RECORD), session_done=True
    )  # the session's only turn: resolved, pending_judge
    dispatcher = _dispatcher(store, fields)
    [job] = store.pending_jobs()
    assert await dispatcher._process(job)
    return _row(store, 0)


async def test_stored_sample_is_the_record_json(store):
    row = await _process_last_turn(store, _good_fields())
    assert row.status == "ready"
    stored = row.sample
    assert Sample.model_validate(stored).to_json() == stored
    assert list(stored)[:13] == list(_good_fields())
    assert list(stored)[13:] == [
        # TurnRecord's fields spelled out on purpose: the test pins the contract, not the constant.
        "prompt_ids",
        "response_ids",
        "rollout_logprobs",
        "weight_version",
        "weight_versions",
        "sampling_params",
        "sample_id",
        "session_id",
        "turn_index",
        "created_at",
        "constrained",
    ]
    assert (stored["prompt_ids"], stored["weight_version"], stored["prm"]) == ([1, 2], "7", PRM)


async def test_turn_fields_are_copied_as_recorded(store):
    """A record without rollout log-probs (or any other turn field) gives nulls in the Sample."""
    minimal = {
        "messages": RECORD["messages"],
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "response": RECORD["response"],
    }
    store.record_turn("s", TurnRecord.model_validate(minimal), session_done=True)
    [job] = store.pending_jobs()
    assert await _dispatcher(store, _good_fields())._process(job)
    row = _row(store, 0)
    assert (row.status, row.reject_reason) == ("ready", None)
    stored = row.sample
    assert (stored["rollout_logprobs"], stored["weight_version"], stored["sampling_params"]) == (None, None, None)
    assert Sample.model_validate(stored).to_json() == stored


async def test_unusable_number_keeps_its_invalid_values_reason(store):
    # A NaN is a float (the typed outcome carries it as written): the store rejects it with the value's reason.
    row = await _process_last_turn(store, {**_good_fields(), "reward": math.nan})
    assert row.status == "rejected"
    assert row.reject_reason == "invalid_values: reward is not a finite number (nan)"


async def test_result_off_the_schema_is_rejected_visibly(store):
    # The pipeline's Sample cannot be built off the schema: its ValidationError is a visible pipeline error.
    row = await _process_last_turn(store, {**_good_fields(), "mode": "rlhf"})
    assert row.status == "rejected"
    assert row.reject_reason.startswith("pipeline_error: sample off the schema: mode: ")
    assert "loss_mask" not in row.sample and row.sample["response_ids"] == [3, 4]
