"""Store hot path on both backends (sqlite, postgresql): one write transaction per turn (with its pairing, an
overtaken turn and the session end), a lost resolution race is a no-op, recording reopens a session the idle sweep
ended; SQLite's sync setting.

A write transaction is one entry into the store's ``_tx`` (one commit on either backend); on SQLite the COMMIT
statements are counted as well and must agree."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import pytest

from engine.records import TurnRecord
from policy_server.store import Resolution, Store
from tests.testkit.records import USER_HI, turn_record
from tests.testkit.servers import samples_of

pytestmark = pytest.mark.unit

U = USER_HI


_record = turn_record


class _CountingConn:
    """Wraps the store's connection and counts COMMITs."""

    def __init__(self, db: sqlite3.Connection):
        self.db, self.commits = db, 0

    def execute(self, sql: str, *a):
        if sql.strip().upper() == "COMMIT":
            self.commits += 1
        return self.db.execute(sql, *a)

    def __getattr__(self, name):
        return getattr(self.db, name)


def _count_commits(st) -> Callable[[], int]:
    """Counts ``st``'s write transactions from now on (see the module docstring); returns the reader."""
    tx, entered = st._tx, [0]

    def counted():
        entered[0] += 1
        return tx()

    st._tx = counted
    conn = None
    if hasattr(st, "_db"):  # SQLite: the COMMIT statements too
        st._db = conn = _CountingConn(st._db)

    def commits() -> int:
        assert conn is None or conn.commits == entered[0]
        return entered[0]

    return commits


def test_record_turn_is_one_transaction_with_overtaken_turn_and_session_end(store_factory):
    st = store_factory()
    st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False)
    commits = _count_commits(st)
    idx = st.record_turn(
        "s", TurnRecord.model_validate(_record()), session_done=True
    )  # overtakes turn 0, ends the session
    assert commits() == 1 and idx == 1
    rows = {r.turn_index: r for r in samples_of(st, "s")}
    assert rows[0].status == "rejected" and rows[0].reject_reason == "concurrent_turns"
    assert rows[1].status == "pending_judge" and st.get_turn("s", 1).pairing == "session_end"
    assert st.session("s").done == 1


def test_resolve_with_touch_is_one_transaction(store_factory):
    st = store_factory()
    st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False, now=100.0)
    commits = _count_commits(st)
    sid = st.resolve_turn("s", Resolution(0, "paired", [U]), touch=True, now=200.0)
    assert commits() == 1 and sid
    assert st.session("s").last_activity == 200.0
    assert st.resolve_turn("s", Resolution(0, "paired", [U])) is None  # idempotent


def test_record_reopens_a_session_ended_while_generating(store_factory):
    st = store_factory()
    st.touch_session("s", now=1.0)
    assert st.idle_sessions(10.0) == ["s"]
    st.end_session("s", now=10.0)  # the idle sweep ended it while its turn was being generated
    st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False, now=11.0)
    assert st.session("s").done == 0 and st.awaiting_turn("s") is not None
    assert st.idle_sessions(12.0 + 1) == ["s"]  # the sweep sees it again later, so the turn is not stranded


@pytest.mark.parametrize("mode,expected", [("normal", 1), ("full", 2)])
def test_synchronous_setting(tmp_path, mode, expected):
    st = Store(tmp_path, synchronous=mode)
    assert st._db.execute("PRAGMA synchronous").fetchone()[0] == expected
    assert st._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(ValueError):
        Store(tmp_path, synchronous="off")


def test_record_with_resolution_is_one_transaction(store_factory):
    st = store_factory()
    st.record_turn("s", TurnRecord.model_validate(_record()), session_done=False, now=100.0)
    commits = _count_commits(st)
    idx = st.record_turn(
        "s", TurnRecord.model_validate(_record()), session_done=False, now=200.0, resolve=Resolution(0, "paired", [U])
    )  # the next turn answers turn 0
    assert commits() == 1 and idx == 1
    assert st.get_turn("s", 0).pairing == "paired" and st.get_turn("s", 0).next_state == [U]
    rows = {r.turn_index: r for r in samples_of(st, "s")}
    assert rows[0].status == "pending_judge" and 1 not in rows  # turn 1 awaits its own next state
    # a resolution that lost a race (turn already resolved) is a no-op, not an error
    st.record_turn(
        "s",
        TurnRecord.model_validate(_record()),
        session_done=False,
        resolve=Resolution(0, "mismatch", None, "x", "history_mismatch"),
    )
    assert st.get_turn("s", 0).pairing == "paired"


async def test_tracker_commits_once_per_continuing_turn(store_factory):
    from policy_server.serving.sessions import SessionTracker

    st = store_factory()
    tracker = SessionTracker(st, idle_timeout_s=5.0)
    first = await tracker.on_request("s", [U], main=True, done=False)
    await tracker.on_main_turn("s", TurnRecord.model_validate(_record()), done=False, arrival=first)
    commits = _count_commits(st)
    follow = [U, {"role": "assistant", "content": "x"}, {"role": "user", "content": "thanks"}]
    arrival = await tracker.on_request("s", follow, main=True, done=False)
    assert commits() == 0 and arrival.resolution.pairing == "paired"  # a read only at arrival
    assert await tracker.sweep_idle(now=10**10) == 0  # in flight: not idle, however old its activity
    await tracker.on_main_turn(
        "s", TurnRecord.model_validate({**_record(), "messages": follow}), done=False, arrival=arrival
    )
    tracker.settle_later(arrival)  # already written with the turn: nothing more
    await tracker.drain_settles()
    assert commits() == 1
    assert st.get_turn("s", 0).next_state == [{"role": "user", "content": "thanks"}]


async def test_pairing_written_alone_when_no_turn_is_recorded(store_factory):
    from policy_server.serving.sessions import SessionTracker

    st = store_factory()
    tracker = SessionTracker(st, idle_timeout_s=5.0)
    await tracker.on_main_turn(
        "s",
        TurnRecord.model_validate(_record()),
        done=False,
        arrival=await tracker.on_request("s", [U], main=True, done=False),
    )
    follow = [U, {"role": "assistant", "content": "x"}, {"role": "user", "content": "wrong"}]
    arrival = await tracker.on_request("s", follow, main=True, done=False)
    tracker.settle_later(arrival)  # e.g. the engine failed: no turn 1, but turn 0's next state is known
    tracker.settle_later(arrival)  # idempotent
    await tracker.drain_settles()
    assert st.get_turn("s", 0).pairing == "paired" and st.awaiting_turn("s") is None
    assert [r.status for r in samples_of(st, "s")] == ["pending_judge"]
    assert await tracker.sweep_idle(now=10**10) == 1  # released: the idle sweep may end it now
