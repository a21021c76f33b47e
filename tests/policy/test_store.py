"""The store's state machine on both backends (SQLite and PostgreSQL: every test runs once per backend).

Contract (policy_server.store): turns are recorded ``awaiting`` and resolved once; a turn overtaken by a
concurrent one is rejected; samples go pending_judge -> ready -> leased -> consumed exactly once, an expired
lease returns its samples and can no longer be acked; everything survives a reopen. Several store
instances on one database (replicas) share all of it: turn indexes, the idle sweep, judge claims and leases.
"""

from __future__ import annotations

import pytest

from engine.records import ModeSnapshot, Sample, TurnRecord
from policy_server.store import LeaseError, Resolution, Store
from policy_server.store.records import AckResult

pytestmark = pytest.mark.unit

U = {"role": "user", "content": "weather in Paris?"}


def _record(n: int = 3) -> dict:
    return {
        "messages": [U],
        "tools": None,
        "prompt_ids": [1, 2],
        "response_ids": list(range(n)),
        "rollout_logprobs": [-0.5] * n,
        "response": {"content": "x"},
        "weight_version": "v0",
        "weight_versions": ["v0"],
        "sampling_params": {},
    }


def _ready_sample(store: Store, sid: str) -> str:
    store.record_turn(sid, TurnRecord.model_validate(_record()), session_done=True)
    [job] = [j for j in store.pending_jobs() if j.session_id == sid]
    assert store.complete_judge(
        job.sample_id,
        status="ready",
        reject_reason=None,
        included=True,
        data=Sample(sample_id=job.sample_id, session_id=sid),
    )
    return job.sample_id


def test_store_turns_pairing_and_session_end(store_factory):
    st = store_factory()
    assert st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False) == 0
    assert st.awaiting_turn("s").turn_index == 0
    sid = st.resolve_turn("s", Resolution(0, "paired", [{"role": "user", "content": "ok"}]))
    assert sid and st.resolve_turn("s", Resolution(0, "paired", None)) is None
    assert (
        st.record_turn("s", TurnRecord.model_validate(_record()), session_done=True) == 1
    )  # last turn: resolved with no next state
    assert st.get_turn("s", 1).pairing == "session_end"
    assert [j.turn_index for j in st.pending_jobs()] == [0, 1]
    st.close()
    st2 = store_factory()  # durable across reopen
    assert [j.turn_index for j in st2.pending_jobs()] == [0, 1]
    assert st2.stats().samples["pending_judge"] == 2


def test_store_concurrent_turns_reject_the_overtaken(store_factory):
    st = store_factory()
    st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False)
    st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False)
    assert st.stats().reject_reasons == {"concurrent_turns": 1}
    assert st.awaiting_turn("s").turn_index == 1


def test_lease_ack_exactly_once_and_expiry(store_factory):
    st = store_factory()
    a, b = _ready_sample(st, "a"), _ready_sample(st, "b")
    lease_id, samples = st.lease(1, lease_s=10, now=100.0)
    assert [s.sample_id for s in samples] == [a]
    lease2, samples2 = st.lease(10, lease_s=10, now=101.0)
    assert [s.sample_id for s in samples2] == [b]  # a is leased: never handed out twice
    assert st.lease(10, lease_s=10, now=102.0) is None
    assert st.ack(lease_id, now=103.0) == AckResult(lease_id=lease_id, acked=1, already_acked=False)
    assert st.ack(lease_id, now=104.0).already_acked is True  # idempotent
    # lease2 expires: b comes back, the old lease can no longer be acked, a (acked) never returns
    lease3, samples3 = st.lease(10, lease_s=10, now=120.0)
    assert [s.sample_id for s in samples3] == [b]
    with pytest.raises(LeaseError) as e:
        st.ack(lease2, now=121.0)
    assert e.value.kind == "expired"
    with pytest.raises(LeaseError):
        st.ack("nope", now=121.5)
    st.ack(lease3, now=122.0)
    assert st.stats().samples["consumed"] == 2 and st.lease(10, 10, now=500.0) is None


def test_complete_judge_rejects_bad_status(store_factory):
    st = store_factory()
    with pytest.raises(ValueError):
        st.complete_judge("x", status="leased", reject_reason=None, included=False, data=Sample())


# ---------------------------------------------------------------- several stores on one database (replicas)
def test_replicas_take_consecutive_turn_indexes(store_factory):
    import threading

    a, b = store_factory(), store_factory()
    got: list[int] = []

    def record(st: Store) -> None:
        for _ in range(10):
            got.append(st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False))

    threads = [threading.Thread(target=record, args=(st,)) for st in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(20))  # no index taken twice, none skipped
    assert a.stats().turns == 20 and b.stats().reject_reasons == {"concurrent_turns": 19}


def test_replicas_never_lease_the_same_sample(store_factory):
    import threading

    a, b = store_factory(), store_factory()
    ids = {_ready_sample(a, f"s{i}") for i in range(40)}
    leased: list[list[str]] = [[], []]

    def take(st: Store, out: list[str]) -> None:
        while (got := st.lease(3, lease_s=60)) is not None:
            out.extend(str(s.sample_id) for s in got[1])
            assert st.ack(got[0]).acked == len(got[1])

    threads = [threading.Thread(target=take, args=(st, out)) for st, out in ((a, leased[0]), (b, leased[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(leased[0]) & set(leased[1])
    assert sorted(leased[0] + leased[1]) == sorted(ids)  # every sample exactly once
    assert b.stats().samples["consumed"] == 40


def test_lease_taken_at_one_replica_is_acked_at_another(store_factory):
    a, b = store_factory(), store_factory()
    _ready_sample(a, "s")
    lease_id, [sample] = a.lease(5, lease_s=60)
    assert b.ack(lease_id).acked == 1 and a.ack(lease_id).already_acked is True
    assert b.lease(5, lease_s=60) is None


def test_idle_sweep_ends_a_session_once_and_spares_a_fresh_one(store_factory):
    a, b = store_factory(), store_factory()
    a.record_turn("s", TurnRecord.model_validate(_record()), session_done=False, now=100.0)
    assert a.idle_sessions(150.0) == ["s"] and b.idle_sessions(150.0) == ["s"]
    ended = [st.end_session("s", now=151.0, idle_before=150.0) for st in (a, b)]
    assert sorted(len(e) for e in ended) == [0, 1]  # exactly one replica closed it
    b.record_turn("t", TurnRecord.model_validate(_record()), session_done=False, now=100.0)
    a.touch_session("t", now=160.0)  # a request arrived at another replica after the sweep listed it
    assert b.end_session("t", now=161.0, idle_before=150.0) == [] and b.session("t").done == 0


def test_judge_claims_are_exclusive_and_expire(store_factory):
    a, b = store_factory(), store_factory()
    a.record_turn("s", TurnRecord.model_validate(_record()), session_done=True, now=100.0)
    assert [j.session_id for j in b.pending_jobs("B", now=100.0)] == ["s"]
    assert a.claim_session("s", "A", 10.0, now=100.0) is True
    assert b.claim_session("s", "B", 10.0, now=101.0) is False
    assert b.pending_jobs("B", now=101.0) == [] and [j.turn_index for j in a.pending_jobs("A", now=101.0)] == [0]
    assert a.claim_session("s", "A", 10.0, now=105.0) is True  # renewal: now until 115
    assert b.claim_session("s", "B", 10.0, now=112.0) is False
    assert b.claim_session("s", "B", 10.0, now=116.0) is True  # A died: its claim expired, B takes over
    b.release_session("s", "A")  # not A's any more: nothing happens
    assert a.claim_session("s", "A", 10.0, now=117.0) is False
    b.release_session("s", "B")
    assert a.claim_session("s", "A", 10.0, now=118.0) is True


def test_runtime_settings_are_shared(store_factory):
    a, b = store_factory(), store_factory()
    a.set_runtime("mode", ModeSnapshot(mode="opd", w_rl=1.0, w_opd=0.5))
    assert b.get_runtime("mode", ModeSnapshot) == ModeSnapshot(mode="opd", w_rl=1.0, w_opd=0.5)


def test_postgres_lock_wait_is_bounded_then_serves_again(pg_url):
    """A row lock held elsewhere (an operator's transaction) makes a write StoreBusy after busy_timeout_s, not a
    hang; the store serves again once it is released (policy_server.store.postgres)."""
    import time

    import psycopg

    from policy_server.errors import StoreBusy
    from policy_server.store import open_store

    st = open_store(pg_url, "", busy_timeout_s=0.5)
    try:
        st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False)
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT * FROM sessions WHERE session_id='s' FOR UPDATE")
            t0 = time.monotonic()
            with pytest.raises(StoreBusy):
                st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False)
            assert (
                time.monotonic() - t0 < 0.5 + 3.0
            )  # busy_timeout_s + loaded-machine slack; the lock is never released
            assert st.probe(0.5) is None  # the database itself answers: only that row is locked
            other.rollback()
        assert st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False) == 1
    finally:
        st.close()
