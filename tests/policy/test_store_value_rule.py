"""The value rule in the store, on SQLite and on PostgreSQL: what a writer may make leasable, what a lease may hand out.

Contract (engine.sample_values, policy_server.store.samples, policy_server.store.leases): a sample whose loss
weights, rollout log-probs, teacher log-probs / temperature, reward or token rewards are unusable is stored
``rejected`` with ``invalid_values: <why>`` and never leased; such a rejection never counts as the session's
included sample (at-least-one); a ``ready`` row that holds an unusable value anyway (written without the check)
is set aside by the lease that reads it, and the good rows of that lease are still handed out.
"""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from engine.records import Sample, TurnRecord
from engine.records import SampleState as S
from engine.sample_values import value_problem
from policy_server.store import Store


def _record() -> dict:
    return {"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.5, -0.25], "messages": []}


def _judged_later(store: Store, sid: str) -> str:
    """A session's only turn, resolved and waiting for its judge (pending_judge); returns its sample id."""
    store.record_turn(sid, TurnRecord.model_validate(_record()), session_done=True)
    [job] = [j for j in store.pending_jobs() if j.session_id == sid]
    return job.sample_id


def _good(sample_id: str, **over) -> dict:
    return {"sample_id": sample_id, "reward": 1.0, "has_reward": True, "loss_mask": [1, 1], **_record(), **over}


def _sample(sample_id: str, **over) -> Sample:
    return Sample.model_validate(_good(sample_id, **over))


@pytest.mark.parametrize(
    "over, why",
    [
        ({"w_rl": math.nan}, "w_rl is not a finite number"),
        ({"w_opd": math.inf}, "w_opd is not a finite number"),
        ({"rollout_logprobs": [-0.5, math.nan]}, "rollout_logprobs holds a non-finite"),
        ({"rollout_logprobs": [-0.5, 0.7]}, "rollout_logprobs holds a positive"),
        ({"teacher_logprobs": [-0.1, -math.inf], "has_teacher": True}, "teacher_logprobs holds a non-finite"),
        ({"teacher_temperature": 0.6}, "teacher_temperature must be 1.0"),
        ({"reward": -math.inf}, "reward is not a finite number"),
        ({"token_rewards": [0.5, math.nan]}, "token_rewards holds a non-finite"),
    ],
)
def test_every_writer_refuses_unusable_values(store_factory, over, why):
    store = store_factory()
    sid = _judged_later(store, "s")
    store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=_sample(sid, **over))
    [row] = store.list_samples(session_id="s", status=None, limit=10)
    assert row.status == S.REJECTED and (row.reject_reason or "").startswith(f"invalid_values: {why}")
    assert store.lease(8, 60) is None


@pytest.mark.parametrize(
    "over, why",
    [
        ({"w_rl": None}, "w_rl is not a finite number"),
        ({"w_opd": "1"}, "w_opd is not a finite number"),
        ({"rollout_logprobs": [-0.5, None]}, "rollout_logprobs holds a non-finite"),
    ],
)
def test_an_unusable_value_off_the_schema_cannot_reach_a_writer(over, why):
    """The writers take Sample records: a value the record refuses never reaches the store, and the value rule
    names it all the same (the reason the dispatcher rejects such a sample with)."""
    with pytest.raises(ValidationError):
        _sample("s", **over)
    assert (value_problem(_good("s", **over)) or "").startswith(why)


def test_a_usable_sample_with_every_field_is_leasable(store_factory):
    store = store_factory()
    sid = _judged_later(store, "s")
    data = _good(sid, w_rl=0.5, w_opd=0.0, teacher_logprobs=[-0.1, 0.0], teacher_temperature=1.0, has_teacher=True)
    store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=Sample.model_validate(data))
    got = store.lease(8, 60)
    assert got is not None and [s.sample_id for s in got[1]] == [sid]


def test_an_invalid_values_rejection_never_counts_as_included(store_factory):
    """The pipeline accepted the turn (included=True) but its reward is NaN: rejected, and the session still has
    no included sample, so at-least-one may promote a later neutral turn."""
    store = store_factory()
    sid = _judged_later(store, "s")
    store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=_sample(sid, reward=math.nan))
    [row] = store.list_samples(session_id="s", status=None, limit=10)
    assert row.status == S.REJECTED and (row.reject_reason or "").startswith("invalid_values: reward")
    assert store.session("s").has_included == 0


def test_a_rejection_passed_as_included_never_counts(store_factory):
    store = store_factory()
    sid = _judged_later(store, "s")
    store.complete_judge(sid, status=S.REJECTED, reject_reason="prm_neutral", included=True, data=None)
    assert store.session("s").has_included == 0


def test_an_accepted_sample_counts_as_included(store_factory):
    store = store_factory()
    sid = _judged_later(store, "s")
    store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=_sample(sid))
    assert store.session("s").has_included == 1


def test_a_poisoned_ready_row_is_set_aside_by_the_lease(store_factory):
    """A ready row holding NaN loss weights (written without the value check): the lease rejects it with the
    reason and still hands out the good row next to it."""
    store = store_factory()
    good, bad = _judged_later(store, "a"), _judged_later(store, "b")
    for sid in (good, bad):
        store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=_sample(sid))
    poisoned = json.dumps(_good(bad, w_rl=math.nan, rollout_logprobs=[math.nan, -0.1]))
    with store._tx() as db:  # bypasses every writer, as an older release or a hand edit would
        db.execute("UPDATE samples SET data=? WHERE sample_id=?", (poisoned, bad))
    got = store.lease(8, 60)
    assert got is not None and [s.sample_id for s in got[1]] == [good]
    statuses = {r.sample_id: (r.status, r.reject_reason) for r in store.list_samples(status=None, limit=10)}
    assert statuses[bad][0] == S.REJECTED and statuses[bad][1].startswith("invalid_values: rollout_logprobs")
    assert store.lease(8, 60) is None  # never handed out later either


def test_a_lease_of_only_poisoned_rows_is_none_and_min_n_counts_good_rows(store_factory):
    store = store_factory()
    ids = [_judged_later(store, f"s{i}") for i in range(3)]
    for sid in ids:
        store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=_sample(sid))
    with store._tx() as db:
        db.execute("UPDATE samples SET data=? WHERE sample_id=?", (json.dumps(_good(ids[0], w_opd=None)), ids[0]))
    assert store.lease(8, 60, min_n=3) is None  # two good rows are fewer than min_n
    got = store.lease(8, 60, min_n=2)
    assert got is not None and sorted(str(s.sample_id) for s in got[1]) == sorted(ids[1:])


def test_a_ready_row_off_the_sample_schema_is_set_aside_and_the_lease_hands_out_records(store_factory):
    """The lease reads each row into its Sample once: a row whose values are usable but whose shape is not a
    Sample (an unknown mode, a flag that is not a bool) is rejected with the schema error; the good row comes
    back as the record whose JSON is exactly the stored JSON."""
    store = store_factory()
    good, mode, flag = (_judged_later(store, s) for s in ("a", "b", "c"))
    for sid in (good, mode, flag):
        store.complete_judge(sid, status=S.READY, reject_reason=None, included=True, data=_sample(sid))
    with store._tx() as db:  # bypasses every writer, as an older release or a hand edit would
        db.execute("UPDATE samples SET data=? WHERE sample_id=?", (json.dumps(_good(mode, mode="sft")), mode))
        db.execute("UPDATE samples SET data=? WHERE sample_id=?", (json.dumps(_good(flag, constrained="yes")), flag))
    got = store.lease(8, 60)
    assert got is not None
    [sample] = got[1]
    assert isinstance(sample, Sample) and sample.to_json() == _good(good) and sample.reward == 1.0
    statuses = {r.sample_id: (r.status, r.reject_reason) for r in store.list_samples(status=None, limit=10)}
    assert statuses[mode][0] == statuses[flag][0] == S.REJECTED
    assert statuses[mode][1].startswith("invalid_values: off the Sample schema: mode: ")
    assert statuses[flag][1].startswith("invalid_values: off the Sample schema: constrained: ")
    assert store.lease(8, 60) is None  # never handed out later either
