"""Users' data in the store, on SQLite and PostgreSQL (policy_server.store.privacy; docs/USERS_DATA.md).

Contract: a turn stored with redacted secrets is never trained (its sample is rejected ``secret``); a session
deletion removes the session's turns, side turns, samples, feedback and stored answers in one transaction,
revokes its leased samples (the lease's ack lists them and consumes nothing of them) and reports those already
consumed with the weight version their ack named; a ``kill -9`` in the middle of a deletion leaves everything
(all or nothing); the audit lists each turn's verdicts; retention purges consumed text and old side turns and,
on SQLite, gives the space back; deleted text is not left in the SQLite file's bytes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.records import PrmVerdict, Sample, TurnRecord, WeightVersion
from policy_server.store import Resolution
from policy_server.store.privacy import PURGED, SessionAudit
from policy_server.store.records import StoredResponse
from tests.testkit.deleting_child import DeletingChild
from tests.testkit.records import turn_record

pytestmark = pytest.mark.unit

SECRET_TEXT = "zebra-quartz-ledger-PLANTED-4417"  # text a deletion must remove from the file's bytes


def _record(text: str = "weather in Paris?", ids: bool = True) -> TurnRecord:
    """The test kit's turn answering ``text``; without ids, as a turn whose prompt held a secret is stored."""
    data = turn_record() | {"messages": [{"role": "user", "content": text}]}
    if not ids:
        data |= {"prompt_ids": [], "response_ids": [], "rollout_logprobs": []}
    return TurnRecord.model_validate(data)


def _judged(store, sid: str, text: str = "hello") -> str:
    """A ready sample of session ``sid`` (one turn, session ended)."""
    store.record_turn(sid, _record(text), session_done=True)
    [job] = [j for j in store.pending_jobs() if j.session_id == sid]
    data = Sample.model_validate(
        {"sample_id": job.sample_id, "session_id": sid, "mode": "rl", "reward": 1.0, "prm": {"votes": [1, 1]}}
    )
    assert store.complete_judge(job.sample_id, status="ready", reject_reason=None, included=True, data=data)
    return job.sample_id


def test_a_redacted_turn_is_rejected_secret_whatever_its_pairing(store_factory):
    st = store_factory()
    st.record_turn("s", _record("[REDACTED:openai_key]", ids=False), session_done=False, redacted=["openai_key"])
    st.record_turn("s", _record("plain"), session_done=True)  # pairs turn 0 (no resolve given: session end)
    rows = {r.turn_index: r for r in st.list_samples(session_id="s")}
    assert rows[0].status == "rejected" and rows[0].reject_reason == "secret: openai_key"
    assert rows[1].status == "pending_judge"
    audit = st.session_audit("s")
    assert audit is not None and audit.turns[0].redacted == ["openai_key"]


def test_delete_session_removes_everything_and_revokes_leases(store_factory):
    st = store_factory()
    consumed = _judged(st, "gone", "first")
    lease_id, _ = st.lease(10, 60.0)
    st.ack(lease_id, weight_version="v7")
    leased = _judged(st, "gone~2", "leased")  # another session of the same family: untouched
    st.record_turn("gone", _record(SECRET_TEXT), session_done=False)
    st.record_side_turn("gone", "opt_out", _record(SECRET_TEXT))
    st.put_response(StoredResponse("resp_1", "gone", None, [{"role": "user", "content": SECRET_TEXT}]))
    ready = _judged(st, "other")
    lease2, got = st.lease(10, 60.0)
    assert {s.sample_id for s in got} == {leased, ready}

    out = st.delete_session("gone")
    assert out is not None
    assert out.deleted.turns == 2 and out.deleted.side_turns == 1 and out.deleted.responses == 1
    assert [(c.sample_id, c.weight_version) for c in out.consumed] == [(consumed, "v7")]
    assert out.revoked == []  # "gone~2" is another session
    assert st.list_samples(session_id="gone") == [] and st.list_side_turns(session_id="gone") == []
    assert st.get_response("resp_1") is None and st.session_audit("gone") is None

    out2 = st.delete_session("gone~2")
    assert out2 is not None and out2.revoked == [leased]
    ack = st.ack(lease2)
    assert ack.acked == 1 and ack.revoked == [leased]  # "other" consumed, the deleted one dropped
    assert st.ack(lease2).revoked == [leased]  # the repeated ack says it again
    assert st.delete_session("never-seen") is None
    # The session row stays without text: its turn indexes keep counting (no record cache can mistake them).
    assert st.record_turn("gone", _record(), session_done=False) == 2


def test_deleted_text_is_not_in_the_sqlite_file(tmp_path: Path):
    from policy_server.store import Store

    st = Store(tmp_path)
    st.record_turn("s", _record(SECRET_TEXT), session_done=False)
    st.record_side_turn("s", "opt_out", _record(SECRET_TEXT))
    st.delete_session("s")
    st.close()
    found = [p.name for p in tmp_path.iterdir() if p.is_file() and SECRET_TEXT.encode() in p.read_bytes()]
    assert found == []


def test_audit_lists_verdicts_and_trained_weight_version(store_factory):
    st = store_factory()
    sample_id = _judged(st, "a")
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id, weight_version="v3")
    audit = st.session_audit("a")
    assert audit is not None
    [turn] = audit.turns
    assert (turn.sample_id, turn.status, turn.mode, turn.reward) == (sample_id, "consumed", "rl", 1.0)
    assert isinstance(turn.prm, PrmVerdict) and turn.prm.votes == [1, 1] and turn.trained_weight_version == "v3"


def test_a_pushed_version_is_what_earlier_consumed_samples_were_trained_into(store_factory):
    """The trainer acks a step's samples after its checkpoint, then pushes those weights: a sample consumed with no
    version named was trained into the first version loaded after its ack; a later sample is not; a version an
    ack named stays."""
    st = store_factory()
    st.ensure_live("v0", "/models/base")
    _judged(st, "early")
    _judged(st, "named")
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id)  # the first ready sample, no version named
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id, weight_version="v7")
    now = time.time()
    pushed = WeightVersion(version="v1", checkpoint="/ckpt/v1", parent="v0", created_at=now, updated_at=now)
    st.add_version(pushed, stale_after_s=600.0)
    st.finish_push("v1", "live", "loaded")
    _judged(st, "late")
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id)
    trained = {
        sid: turn.trained_weight_version
        for sid in ("early", "named", "late")
        for turn in (st.session_audit(sid) or SessionAudit(session_id=sid, turns=[])).turns
    }
    assert sorted(trained.values(), key=str) == sorted(["v1", "v7", None], key=str), trained
    assert trained["late"] is None


def test_retention_purges_consumed_text_and_old_side_turns(store_factory):
    st = store_factory()
    _judged(st, "old", SECRET_TEXT * 200)
    lease_id, _ = st.lease(10, 60.0)
    st.ack(lease_id)
    st.record_side_turn(None, "title", _record(SECRET_TEXT))
    _judged(st, "young")  # ready, not consumed: kept
    out = st.sweep_retention(consumed_before=time.time() + 1, side_before=time.time() + 1)
    assert (out.consumed_samples, out.turns, out.side_turns) == (1, 1, 1)
    [row] = st.list_samples(session_id="old")
    assert row.status == "consumed" and row.sample is None
    assert st.get_turn("old", 0).messages == [] and st.get_turn("old", 0).prompt_ids == []  # record purged
    assert st.list_samples(session_id="young")[0].status == "ready"
    assert st.sweep_retention(consumed_before=time.time() + 1, side_before=None).consumed_samples == 0


def test_retention_returns_sqlite_space(tmp_path: Path):
    from policy_server.store import Store

    st = Store(tmp_path)
    for i in range(40):
        _judged(st, f"s{i}", SECRET_TEXT * 400)
    lease_id, _ = st.lease(64, 60.0)
    st.ack(lease_id)
    st._return_space(vacuum=True)
    before = st.file_bytes()
    st.sweep_retention(consumed_before=time.time() + 1, side_before=None)
    after = st.file_bytes()
    st.close()
    assert before is not None and after is not None and after < before / 2
    assert not any(SECRET_TEXT.encode() in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())


def test_a_small_purge_leaves_the_file_for_new_rows(tmp_path: Path):
    """VACUUM rewrites the whole file under the store lock: a sweep that frees little does not run it (the freed
    pages are zeroed by secure_delete and reused), one that frees half of the file does (above)."""
    from policy_server.store import Store

    st = Store(tmp_path)
    _judged(st, "old", SECRET_TEXT * 20)
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id)
    for i in range(40):
        _judged(st, f"kept{i}", "ordinary text " * 400)  # ready, not consumed: kept
    st._return_space(vacuum=False)  # the WAL in the file, so its size is the database's
    before = st.file_bytes()
    out = st.sweep_retention(consumed_before=time.time() + 1, side_before=None)
    after = st.file_bytes()
    st.close()
    assert out.consumed_samples == 1 and after == before
    assert not any(SECRET_TEXT.encode() in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())


def _consumed_sessions(store, sessions: int, turns: int, text: str = "hello", ids: int = 0) -> None:
    """``sessions`` ended sessions of ``turns`` paired turns each, every sample judged (with ``ids`` prompt token
    ids) and consumed."""
    for i in range(sessions):
        for k in range(turns):
            resolve = Resolution(k - 1, "paired", [{"role": "user", "content": "next"}]) if k else None
            store.record_turn(f"c{i}", _record(text), session_done=k == turns - 1, resolve=resolve)
    for job in store.pending_jobs():
        data = Sample.model_validate(
            {"sample_id": job.sample_id, "session_id": job.session_id, "reward": 1.0, "prompt_ids": list(range(ids))}
        )
        store.complete_judge(job.sample_id, status="ready", reject_reason=None, included=True, data=data)
    lease = store.lease(sessions * turns, 60.0)
    assert lease is not None and len(lease[1]) == sessions * turns
    store.ack(lease[0])


def test_a_sweep_in_batches_purges_what_one_transaction_would(store_factory):
    """Sessions whose samples fall in two batches still have their turn records purged; side turns go in
    batches too."""
    st = store_factory()
    _consumed_sessions(st, sessions=4, turns=3, text=SECRET_TEXT)
    for _ in range(5):
        st.record_side_turn(None, "opt_out", _record(SECRET_TEXT))
    out = st.sweep_retention(consumed_before=time.time() + 1, side_before=time.time() + 1, batch_rows=5)
    assert (out.consumed_samples, out.turns, out.side_turns) == (12, 12, 5)
    assert all(r.sample is None for r in st.list_samples())
    assert all(st.get_turn(f"c{i}", k).messages == [] for i in range(4) for k in range(3))
    with pytest.raises(ValueError):
        st.sweep_retention(consumed_before=time.time(), side_before=None, batch_rows=0)


def test_a_turn_committed_during_a_long_sweep_waits_for_a_batch_not_the_whole_sweep(tmp_path: Path):
    """SQLite has one writer: a sweep in one transaction made every turn's commit wait for all of it (past
    ``busy_timeout_s``, StoreBusy). In batches, a commit waits for one batch at most."""
    import threading

    from policy_server.store import Store
    from policy_server.store.privacy import RETENTION_BATCH_ROWS

    st = Store(tmp_path)
    _consumed_sessions(st, sessions=2 * RETENTION_BATCH_ROWS, turns=5, text=SECRET_TEXT * 300, ids=3000)  # 10 batches
    writes: list[tuple[float, float]] = []  # (start, end) of each commit
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            st.record_turn(f"w{len(writes)}", _record(), session_done=False)
            writes.append((t0, time.perf_counter()))
            time.sleep(0.001)

    writer = threading.Thread(target=write)
    writer.start()
    while len(writes) < 3:  # the writer is committing before the sweep starts
        time.sleep(0.001)
    t0 = time.perf_counter()
    out = st.sweep_retention(consumed_before=time.time() + 1, side_before=None)
    t1 = time.perf_counter()
    stop.set()
    writer.join()
    st.close()
    assert out.consumed_samples == 10 * RETENTION_BATCH_ROWS
    longest = max(end - start for start, end in writes if end > t0 and start < t1)
    assert longest < (t1 - t0) / 3, f"a commit waited {longest:.3f}s of the sweep's {t1 - t0:.3f}s"


def test_the_sweep_reads_unpurged_samples_by_their_partial_index(tmp_path: Path):
    """The sweep's query states the partial index's WHERE, so an empty sweep reads no purged row."""
    from policy_server.store import Store
    from policy_server.store.privacy import UNPURGED

    st = Store(tmp_path)
    with st._read() as db:
        plan = " ".join(str(tuple(r)) for r in db.execute("EXPLAIN QUERY PLAN " + UNPURGED, (1.0, 5)).fetchall())
    st.close()
    assert "samples_unpurged" in plan, plan


@pytest.mark.process
def test_kill_9_during_a_deletion_deletes_nothing(store_factory, store_url: str, tmp_path: Path):
    st = store_factory()
    _judged(st, "victim", SECRET_TEXT)
    st.record_turn("victim", _record(), session_done=False)
    st.record_side_turn("victim", "opt_out", _record())
    st.close()
    child = DeletingChild(store_url, "victim", tmp_path / "unused")
    child.kill9()
    st2 = store_factory()
    assert len(st2.list_samples(session_id="victim")) == 1
    assert st2.get_turn("victim", 0) is not None and st2.get_turn("victim", 1) is not None
    assert len(st2.list_side_turns(session_id="victim")) == 1
    out = st2.delete_session("victim")  # and the deletion, run again, completes
    assert out is not None and (out.deleted.turns, out.deleted.samples, out.deleted.side_turns) == (2, 1, 1)


def test_purged_record_marker_is_json():
    import json

    assert json.loads(PURGED) == {"purged": True}


def test_the_sweeper_counts_what_it_purged_and_the_space_returned(tmp_path: Path):
    from policy_server.metrics import Metrics
    from policy_server.serving.retention import sweep_once
    from policy_server.settings import PolicySettings
    from policy_server.store import Store

    st = Store(tmp_path)
    for i in range(20):
        _judged(st, f"s{i}", SECRET_TEXT * 400)
    lease_id, _ = st.lease(64, 60.0)
    st.ack(lease_id)
    st.record_side_turn(None, "opt_out", _record())
    st._return_space(vacuum=True)
    metrics = Metrics()
    kept = PolicySettings(model_path="m", engine_url="http://127.0.0.1:1")
    assert sweep_once(st, kept, metrics) == sweep_once(st, kept, metrics)  # nothing set: nothing purged
    settings = kept.model_copy(update={"consumed_text_retention_s": 10.0, "side_turn_retention_s": 10.0})
    out = sweep_once(st, settings, metrics, now=time.time() + 60)
    st.close()
    assert (out.consumed_samples, out.turns, out.side_turns) == (20, 20, 1)
    value = metrics.registry.get_sample_value
    assert value("hindsight_policy_retention_sweeps_total") == 3
    assert value("hindsight_policy_deleted_rows_total", {"table": "samples", "cause": "retention"}) == 20
    assert value("hindsight_policy_deleted_rows_total", {"table": "side_turns", "cause": "retention"}) == 1
    assert (value("hindsight_policy_retention_reclaimed_bytes_total") or 0) > 0


def test_a_judge_outcome_after_the_deletion_writes_nothing(store_factory):
    st = store_factory()
    st.record_turn("j", _record(), session_done=True)
    [job] = [j for j in st.pending_jobs() if j.session_id == "j"]  # the dispatcher picked it: judging now
    deleted = st.delete_session("j")
    assert deleted is not None and deleted.deleted.samples == 1
    data = Sample.model_validate({"sample_id": job.sample_id, "session_id": "j", "mode": "rl", "reward": 1.0})
    assert not st.complete_judge(job.sample_id, status="ready", reject_reason=None, included=True, data=data)
    assert st.list_samples(session_id="j") == [] and st.get_turn("j", 0) is None and st.session("j").done
    assert [j for j in st.pending_jobs() if j.session_id == "j"] == []
