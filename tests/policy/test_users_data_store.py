"""Users' data in the store, on SQLite and PostgreSQL (policy_server.store.privacy, policy_server.store.retention;
docs/USERS_DATA.md).

Contract: a turn stored with redacted secrets is never trained (its sample is rejected ``secret``); a session
deletion removes the session's turns, side turns, samples, feedback and stored answers in one transaction,
revokes its leased samples (the lease's ack lists them and consumes nothing of them) and reports those already
consumed with the weight version their ack named; a ``kill -9`` in the middle of a deletion leaves everything
(all or nothing); the audit lists each turn's verdicts; retention purges the text of terminal samples (consumed or
rejected) and of the sessions they settle, and old side turns, in batches of bounded rows, and on SQLite gives the
space back by incremental vacuum in chunks of bounded lock time (a store from before it: VACUUM past half free, or
converted offline); deleted text is not left in the SQLite file's bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from engine.records import PrmVerdict, Sample, TurnRecord, WeightVersion
from policy_server.store import Resolution
from policy_server.store.privacy import SessionAudit
from policy_server.store.records import StoredResponse
from policy_server.store.retention import PURGED
from tests.testkit.deleting_child import DeletingChild
from tests.testkit.records import turn_record

T = TypeVar("T")

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
    out = st.sweep_retention(text_before=time.time() + 1, side_before=time.time() + 1)
    assert (out.samples, out.turns, out.side_turns) == (1, 1, 1)
    [row] = st.list_samples(session_id="old")
    assert row.status == "consumed" and row.sample is None
    assert st.get_turn("old", 0).messages == [] and st.get_turn("old", 0).prompt_ids == []  # record purged
    assert st.list_samples(session_id="young")[0].status == "ready"
    assert st.sweep_retention(text_before=time.time() + 1, side_before=None).samples == 0


def _two_turns(store, sid: str, text: str = SECRET_TEXT) -> tuple[str, str]:
    """An ended session of two turns: the first paired (judged ready), the last without a next state (judged
    rejected ``no_next_state`` with its Sample JSON, as rl mode does); their sample ids."""
    store.record_turn(sid, _record(text), session_done=False)
    store.record_turn(sid, _record(text), session_done=True, resolve=Resolution(0, "paired", [{"role": "user"}]))
    ids = []
    for job in sorted((j for j in store.pending_jobs() if j.session_id == sid), key=lambda j: j.turn_index):
        data = Sample.model_validate(
            {"sample_id": job.sample_id, "session_id": sid, "mode": "rl", "reward": 1.0, "prm": {"votes": [1, 1]}}
        )
        if job.turn_index == 0:
            store.complete_judge(job.sample_id, status="ready", reject_reason=None, included=True, data=data)
        else:
            store.complete_judge(
                job.sample_id, status="rejected", reject_reason="no_next_state", included=False, data=data
            )
        ids.append(job.sample_id)
    return ids[0], ids[1]


def _text_left(store, sid: str) -> dict[str, object]:
    """What of a session's text the store still holds: sample JSON by status, turn messages, feedback texts."""
    return {
        "samples": sorted((r.status, r.sample is not None) for r in store.list_samples(session_id=sid)),
        "turns": [bool(store.get_turn(sid, k).messages) for k in range(len(store.list_samples(session_id=sid)))],
        "feedback": [f.text for f in store.list_feedback(session_id=sid)],
    }


def test_a_session_with_a_consumed_and_a_rejected_sample_ends_fully_purged(store_factory):
    """The rejected sample is terminal too: its JSON goes after the retention, and once every sample of the
    session is purged its turns, next states, feedback and stored answers go; a session whose only sample was
    rejected before judging (no JSON: a secret) has its turns purged as well."""
    st = store_factory()
    _two_turns(st, "mixed")
    st.add_feedback("mixed", 0, value=1.0, text=SECRET_TEXT, idempotency_key=None, policy="override")
    st.put_response(StoredResponse("resp_m", "mixed", None, [{"role": "user", "content": SECRET_TEXT}]))
    lease_id, _ = st.lease(10, 60.0)
    st.ack(lease_id)
    st.record_turn("redacted", _record("[REDACTED:openai_key]", ids=False), session_done=True, redacted=["openai_key"])
    assert st.list_samples(session_id="redacted")[0].reject_reason == "secret: openai_key"
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None)
    assert (out.samples, out.turns) == (3, 3)
    assert _text_left(st, "mixed") == {
        "samples": [("consumed", False), ("rejected", False)],
        "turns": [False, False],
        "feedback": [],
    }
    assert st.get_turn("mixed", 0).next_state is None and st.get_response("resp_m") is None
    assert _text_left(st, "redacted")["turns"] == [False]
    assert st.sweep_retention(text_before=time.time() + 1, side_before=None) == out.__class__(0, 0, 0)


def test_a_session_with_a_sample_still_ready_or_leased_keeps_what_that_sample_needs(store_factory):
    """A rejected sample of a settled session is purged at once, but the turns wait for the ready one: it keeps its
    JSON while ready and while leased, and once consumed and purged the session goes whole."""
    st = store_factory()
    _two_turns(st, "live")
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None)
    assert (out.samples, out.turns) == (1, 0)
    assert _text_left(st, "live") == {
        "samples": [("ready", True), ("rejected", False)],
        "turns": [True, True],
        "feedback": [],
    }
    lease_id, _ = st.lease(10, 60.0)
    assert st.sweep_retention(text_before=time.time() + 1, side_before=None).samples == 0
    assert _text_left(st, "live")["samples"] == [("leased", True), ("rejected", False)]
    st.ack(lease_id)
    assert st.sweep_retention(text_before=time.time() - 60, side_before=None).samples == 0  # acked just now
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None)
    assert (out.samples, out.turns) == (1, 2)
    assert _text_left(st, "live")["turns"] == [False, False]


def test_a_rejected_sample_waits_until_its_session_is_settled(store_factory):
    """No turn awaiting, no sample being judged or held: a session scorer reads the rejected turns' verdicts, so a
    rejected sample of a session still going on keeps its JSON past the retention."""
    st = store_factory()
    st.record_turn("open", _record(), session_done=False)
    st.record_turn("open", _record(), session_done=False, resolve=Resolution(0, "paired", [{"role": "user"}]))
    [job] = st.pending_jobs()
    data = Sample.model_validate({"sample_id": job.sample_id, "session_id": "open", "mode": "rl", "prm": {}})
    st.complete_judge(job.sample_id, status="rejected", reject_reason="prm_neutral", included=False, data=data)
    later = time.time() + 1
    assert st.sweep_retention(text_before=later, side_before=None).samples == 0  # turn 1 awaits its next state
    [last] = st.end_session("open")
    assert st.sweep_retention(text_before=later, side_before=None).samples == 0  # turn 1 is being judged
    st.complete_judge(last, status="rejected", reject_reason="no_next_state", included=False, data=None)
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None)
    assert (out.samples, out.turns) == (2, 2)


def test_feedback_after_the_purge_re_includes_nothing_and_keeps_no_text(store_factory):
    """Feedback can re-include a sample rejected for its reward signal only while its JSON is kept: the retention
    is that feedback's window. Later feedback is recorded, without its text."""
    st = store_factory()
    _, rejected = _two_turns(st, "fb")
    lease_id, _ = st.lease(10, 60.0)
    st.ack(lease_id)
    st.sweep_retention(text_before=time.time() + 1, side_before=None)
    answer = st.add_feedback("fb", 1, value=1.0, text=SECRET_TEXT, idempotency_key=None, policy="override")
    assert answer is not None and answer.state == "recorded" and answer.sample_status == "rejected"
    assert [f.text for f in st.list_feedback(session_id="fb")] == [None]
    assert [r.status for r in st.list_samples(session_id="fb") if r.sample_id == rejected] == ["rejected"]


def test_retention_returns_sqlite_space(tmp_path: Path):
    from policy_server.store import Store

    st = Store(tmp_path)
    for i in range(40):
        _judged(st, f"s{i}", SECRET_TEXT * 400)
    lease_id, _ = st.lease(64, 60.0)
    st.ack(lease_id)
    st._return_space(vacuum=True)
    before = st.file_bytes()
    st.sweep_retention(text_before=time.time() + 1, side_before=None)
    after = st.file_bytes()
    st.close()
    assert before is not None and after is not None and after < before / 2
    assert not any(SECRET_TEXT.encode() in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())


def test_a_new_store_returns_even_a_small_purge_to_the_filesystem(tmp_path: Path):
    """A store this release creates has incremental auto-vacuum: a sweep returns the pages it freed, however few,
    in chunks of bounded lock time (no whole-file VACUUM)."""
    from policy_server.store import Store

    st = Store(tmp_path)
    assert st.incremental_vacuum
    _judged(st, "old", SECRET_TEXT * 2000)  # ~64 KB of text, twice (turn record and sample JSON)
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id)
    for i in range(40):
        _judged(st, f"kept{i}", "ordinary text " * 400)  # ready, not consumed: kept
    st._return_space(vacuum=False)  # the WAL in the file, so its size is the database's
    before = st.file_bytes()
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None)
    after = st.file_bytes()
    with st._read() as db:
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
    st.close()
    assert out.samples == 1 and before is not None and after is not None
    assert before - after > 64_000 and free == 0, (before, after, free)
    assert not any(SECRET_TEXT.encode() in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())


def _legacy_store(tmp_path: Path):
    """A store as the releases before incremental auto-vacuum created it (its first table made without it)."""
    import sqlite3

    from policy_server.store import Store

    tmp_path.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(tmp_path / "hindsight.sqlite3")
    db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL)")
    db.close()
    return Store(tmp_path)


def test_a_store_without_incremental_vacuum_is_rebuilt_only_past_half_free_and_converted(tmp_path: Path):
    """A store created before this release is rebuilt whole (VACUUM, every turn waits for it) only once half of
    it is free; that VACUUM converts it to incremental auto-vacuum. The freed pages meanwhile are zeroed."""
    st = _legacy_store(tmp_path)
    assert not st.incremental_vacuum
    _judged(st, "old", SECRET_TEXT * 20)
    lease_id, _ = st.lease(1, 60.0)
    st.ack(lease_id)
    for i in range(40):
        _judged(st, f"kept{i}", "ordinary text " * 2000)
    st._return_space(vacuum=False)
    before = st.file_bytes()
    assert st.sweep_retention(text_before=time.time() + 1, side_before=None).samples == 1
    assert st.file_bytes() == before and not st.incremental_vacuum  # a small purge: no VACUUM
    assert not any(SECRET_TEXT.encode() in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    lease_id, _ = st.lease(64, 60.0)
    st.ack(lease_id)
    st.sweep_retention(text_before=time.time() + 1, side_before=None)  # now most of the file is free
    after = st.file_bytes()
    st.close()
    assert before is not None and after is not None and after < before / 2
    assert st.incremental_vacuum


def test_the_migrate_step_converts_a_store_without_incremental_vacuum(tmp_path: Path):
    st = _legacy_store(tmp_path)
    _judged(st, "a")
    done = st.upgrade_file()
    assert done is not None and "incremental auto-vacuum" in done and st.incremental_vacuum
    assert st.upgrade_file() is None  # nothing left to do
    assert st.list_samples(session_id="a")[0].status == "ready"
    st.close()


def test_a_turn_committed_during_a_long_incremental_vacuum_waits_for_a_chunk(tmp_path: Path):
    """Incremental vacuum returns the free pages in chunks of VACUUM_CHUNK_PAGES, each one hold of the store, with
    a pause between them: a commit meanwhile waits for one chunk, never for the whole return."""

    from policy_server.store import Store
    from policy_server.store.sqlite import VACUUM_CHUNK_PAGES

    st = Store(tmp_path)
    rows = 12 * VACUUM_CHUNK_PAGES  # two pages each: every other one deleted frees 12 chunks
    with st._tx() as db:  # the freed pages lie between live ones: returning them moves pages, as after a sweep
        db.executemany(
            "INSERT INTO side_turns (side_id, session_id, created_at, rule, record) VALUES (?, NULL, ?, 'x', ?)",
            [(f"side-{i}", i % 2, f"{i:08d}" * 1000) for i in range(rows)],
        )
    with st._tx() as db:
        db.execute("DELETE FROM side_turns WHERE created_at=0")
    with st._read() as db:
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
    assert free > 10 * VACUUM_CHUNK_PAGES, free
    before = st.file_bytes()
    _, longest, took = _while_committing(st, lambda: st._return_space(vacuum=True))
    after = st.file_bytes()
    st.close()
    assert before is not None and after is not None and before - after > (free - 100) * 4096
    assert longest < took / 3, f"a commit waited {longest:.3f}s of the vacuum's {took:.3f}s"


def _while_committing(st, work: Callable[[], T]) -> tuple[T, float, float]:
    """Run ``work`` while a thread commits small turns back to back (already committing when it starts): (its
    result, the longest commit that overlapped it, how long it took), in seconds."""
    import threading

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
    while len(writes) < 3:
        time.sleep(0.001)
    t0 = time.perf_counter()
    try:
        out = work()
    finally:
        t1 = time.perf_counter()
        stop.set()
        writer.join()
    return out, max(end - start for start, end in writes if end > t0 and start < t1), t1 - t0


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
    out = st.sweep_retention(text_before=time.time() + 1, side_before=time.time() + 1, batch_rows=5)
    assert (out.samples, out.turns, out.side_turns) == (12, 12, 5)
    assert all(r.sample is None for r in st.list_samples())
    assert all(st.get_turn(f"c{i}", k).messages == [] for i in range(4) for k in range(3))
    with pytest.raises(ValueError):
        st.sweep_retention(text_before=time.time(), side_before=None, batch_rows=0)


def test_a_batch_counts_the_turns_it_purges(store_factory):
    """The turns a batch's samples settle count in the batch: sessions whose last sample is purged after the others
    (rl rejects each session's last turn) go a few a transaction, never a batch of sessions with all their turns."""
    from contextlib import contextmanager

    st = store_factory()
    for i in range(6):
        _two_turns(st, f"r{i}")
    lease_id, _ = st.lease(10, 60.0)
    st.ack(lease_id)
    inner, purged = st._tx, []

    def rows() -> int:
        with st._read() as db:
            return (
                db.execute("SELECT COUNT(*) FROM samples WHERE purged_at IS NOT NULL").fetchone()[0]
                + (db.execute("SELECT COUNT(*) FROM turns WHERE record=?", (PURGED,)).fetchone()[0])
            )

    @contextmanager
    def tx():
        before = rows()
        with inner() as db:
            yield db
        purged.append(rows() - before)

    st._tx = tx
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None, batch_rows=3)  # each rejected one settles
    del st._tx
    assert (out.samples, out.turns) == (12, 12)
    assert max(purged) <= 3 + 2, purged  # the batch, and at most one session's turns past it


def test_a_turn_committed_during_a_long_sweep_waits_for_a_batch_not_the_whole_sweep(tmp_path: Path):
    """SQLite has one writer: a sweep in one transaction made every turn's commit wait for all of it (past
    ``busy_timeout_s``, StoreBusy). In batches, a commit waits for one batch at most."""

    from policy_server.store import Store
    from policy_server.store.retention import RETENTION_BATCH_ROWS

    st = Store(tmp_path)
    _consumed_sessions(st, sessions=2 * RETENTION_BATCH_ROWS, turns=5, text=SECRET_TEXT * 300, ids=3000)  # 10 batches
    out, longest, took = _while_committing(
        st, lambda: st.sweep_retention(text_before=time.time() + 1, side_before=None)
    )
    st.close()
    assert out.samples == 10 * RETENTION_BATCH_ROWS
    assert longest < took / 3, f"a commit waited {longest:.3f}s of the sweep's {took:.3f}s"


def test_the_sweep_reads_unpurged_samples_by_their_partial_index(tmp_path: Path):
    """Each of the sweep's queries states the partial index's WHERE, so an empty sweep reads no purged row."""
    from policy_server.store import Store
    from policy_server.store.retention import UNPURGED_CONSUMED, UNPURGED_REJECTED

    st = Store(tmp_path)
    with st._read() as db:
        plans = [
            " ".join(str(tuple(r)) for r in db.execute("EXPLAIN QUERY PLAN " + q, (1.0, 5)).fetchall())
            for q in (UNPURGED_CONSUMED, UNPURGED_REJECTED)
        ]
    st.close()
    assert all("samples_unpurged" in plan for plan in plans), plans


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
    assert (out.samples, out.turns, out.side_turns) == (20, 20, 1)
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


def test_the_sweeper_logs_its_totals_at_most_once_a_minute():
    """Each sweep is a DEBUG line; the totals are an INFO line when something was purged and the previous line is
    a minute old: a sweep every 5 s that purges each time logs once a minute, not 12 times."""
    from policy_server.serving.retention import LOG_EVERY_S, PurgeLog, PurgeTotals
    from policy_server.store.retention import RetentionSweep

    log = PurgeLog(now=0.0)
    one, none = RetentionSweep(samples=2, turns=1, side_turns=0), RetentionSweep(0, 0, 0)
    lines = [(t, log.add(one, now=t)) for t in range(5, 181, 5)]
    due = [(t, x) for t, x in lines if x is not None]
    assert [t for t, _ in due] == [60, 120, 180] and LOG_EVERY_S == 60
    assert due[0][1] == PurgeTotals(sweeps=12, samples=24, turns=12, side_turns=0, seconds=60.0)
    assert [log.add(none, now=t) for t in range(185, 400, 5)] == [None] * 43  # nothing purged: silent
    assert log.add(one, now=400.0) == PurgeTotals(sweeps=44, samples=2, turns=1, side_turns=0, seconds=220.0)
