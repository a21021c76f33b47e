"""Concurrent ledger changes at two replicas, on both backends (policy_server.store.versions).

Contract: the ledger's changes (push, finish of a push, promotion, rollback) serialise, at every replica, so two
that overlap end exactly as if the first had committed before the second began: a push and a rollback, a push's
finish and a rollback, a promotion and a rollback. The ledger then never holds a candidate, canary or live version
whose parent was rolled back, always exactly one live version, and no pending version that a push made after the
rollback would be refused for (no parent while the restored version requires one). A rollback rolls back the
candidate that is still loading too, so its push cannot finish (``weights_rolled_back``); the server's push then
answers 409 and loads the live version's weights back (policy_server.serving.versions).

How the overlap is forced: the first change runs in a thread with its transaction held open after its last
statement, just before its commit; the second change runs meanwhile from another store (another connection: on
PostgreSQL another replica's) and is given ``OVERLAP_S`` to finish before the first commits. A ledger whose changes
do not serialise lets the second decide on what the first has not committed yet (PostgreSQL's READ COMMITTED),
which the final states below catch; one that serialises holds the second until the first commits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from engine.records import WeightsUpdated, WeightVersion
from policy_server.errors import Conflict
from policy_server.serving.versions import Push, VersionControl
from policy_server.serving.weight_sync import WeightGate, WeightSync
from policy_server.store import VersionConflict
from tests.policy.test_version_ledger import STALE_S, push, states

OVERLAP_S = 1.0  # how long the second change may run while the first holds its transaction open
JOIN_S = 30.0


@contextmanager
def _held_before_commit(store, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every transaction of ``store`` waits, after its last statement and before its commit, until the yielded event
    is set; ``held`` (the attribute on the event) is set once one waits."""
    release = threading.Event()
    release.held = threading.Event()  # type: ignore[attr-defined]
    original = store._tx

    @contextmanager
    def tx():
        with original() as db:
            yield db
            release.held.set()  # type: ignore[attr-defined]
            release.wait(JOIN_S)

    monkeypatch.setattr(store, "_tx", tx)
    try:
        yield release
    finally:
        release.set()


def _run(change: Callable[[], object], out: list[object]) -> threading.Thread:
    def target() -> None:
        try:
            out.append(change())
        except BaseException as exc:  # recorded: a conflict is an outcome, anything else fails the test below
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _outcome(result: object) -> str:
    if isinstance(result, VersionConflict):
        return result.code
    assert not isinstance(result, BaseException), f"not a ledger outcome: {result!r}"
    return "ok"


def _assert_consistent(store) -> None:
    """The ledger invariants that hold after any sequence of ledger changes."""
    versions = {v.version: v for v in store.list_versions()}
    live = [v for v in versions.values() if v.state == "live"]
    assert len(live) == 1, f"live versions: {[v.version for v in live]}"
    for v in versions.values():
        parent = versions.get(v.parent) if v.parent is not None else None
        if v.state in ("candidate", "canary", "live") and parent is not None:
            assert parent.state != "rolled_back", f"{v.version} ({v.state}) descends from rolled-back {parent.version}"
        if v.state in ("candidate", "canary"):
            assert parent is not None or not live[0].parent_required, f"{v.version} names no parent after a rollback"


# The ledger every race starts from: R retired, L (trained from R) live; ``C`` a candidate or canary of L.
def _ledger(store, c_state: str | None) -> None:
    store.ensure_live("R", "/ckpt/R")
    store.add_version(push("L", "R"), stale_after_s=STALE_S)
    store.finish_push("L", "live", "direct")
    if c_state is not None:
        store.add_version(push("C", "L"), stale_after_s=STALE_S)
        if c_state == "canary":
            store.finish_push("C", "canary", "loaded")


def _push(parent: str | None) -> Callable[[object], WeightVersion]:
    return lambda store: store.add_version(push("C", parent), stale_after_s=STALE_S)


def _roll_back(store) -> object:
    return store.roll_back("R", "worse")


@dataclass(frozen=True)
class Race:
    c_state: str | None  # C before the race: None (no C), candidate, canary
    first: Callable[[object], object]
    second: Callable[[object], object]
    outcomes: tuple[str, str]  # first's, second's: "ok" or the conflict code
    final: dict[str, str]


RACES = {
    "push-then-rollback": Race(
        None, _push("L"), _roll_back, ("ok", "ok"), {"C": "rolled_back", "L": "rolled_back", "R": "live"}
    ),
    "rollback-then-push": Race(
        None, _roll_back, _push("L"), ("ok", "weights_rolled_back"), {"L": "rolled_back", "R": "live"}
    ),
    "parentless-push-then-rollback": Race(
        None, _push(None), _roll_back, ("ok", "ok"), {"C": "rolled_back", "L": "rolled_back", "R": "live"}
    ),
    "rollback-then-parentless-push": Race(
        None, _roll_back, _push(None), ("ok", "parent_required"), {"L": "rolled_back", "R": "live"}
    ),
    "finish-then-rollback": Race(
        "candidate",
        lambda s: s.finish_push("C", "live", "direct"),
        _roll_back,
        ("ok", "ok"),
        {"C": "rolled_back", "L": "retired", "R": "live"},
    ),
    "rollback-then-finish": Race(
        "candidate",
        _roll_back,
        lambda s: s.finish_push("C", "live", "direct"),
        ("ok", "weights_rolled_back"),
        {"C": "rolled_back", "L": "rolled_back", "R": "live"},
    ),
    "promote-then-rollback": Race(
        "canary",
        lambda s: s.promote("better"),
        _roll_back,
        ("ok", "ok"),
        {"C": "rolled_back", "L": "retired", "R": "live"},
    ),
    "rollback-then-promote": Race(
        "canary",
        _roll_back,
        lambda s: s.promote("better"),
        ("ok", "no_canary"),
        {"C": "rolled_back", "L": "rolled_back", "R": "live"},
    ),
}


@pytest.mark.parametrize("name", sorted(RACES))
def test_overlapping_ledger_changes_end_as_if_one_came_first(store_factory, monkeypatch, name: str) -> None:
    race = RACES[name]
    setup, first, second = store_factory(), store_factory(), store_factory()  # three connections
    _ledger(setup, race.c_state)
    first_out: list[object] = []
    second_out: list[object] = []
    with _held_before_commit(first, monkeypatch) as release:
        first_thread = _run(lambda: race.first(first), first_out)
        assert release.held.wait(JOIN_S), first_out  # type: ignore[attr-defined]
        second_thread = _run(lambda: race.second(second), second_out)
        second_thread.join(OVERLAP_S)  # a ledger that serialises holds it until the first commits
        release.set()
        first_thread.join(JOIN_S)
        second_thread.join(JOIN_S)
    assert not first_thread.is_alive() and not second_thread.is_alive()
    assert (_outcome(first_out[0]), _outcome(second_out[0])) == race.outcomes
    assert states(setup) == race.final
    _assert_consistent(setup)
    assert setup.get_version("R").parent_required
    with pytest.raises(VersionConflict) as exc:  # the trainer must reload R before it pushes again
        setup.add_version(push("D", None), stale_after_s=STALE_S)
    assert exc.value.code == "parent_required"


class _Engines(WeightSync):
    """The engines as a push sees them: each load recorded (no engine); ``during_load`` runs once, mid-load."""

    def __init__(self) -> None:
        super().__init__([], WeightGate(timeout_s=5.0))
        self.loads: list[str] = []
        self.during_load: Callable[[], object] | None = None

    async def update(self, model_path: str, weight_version: str, workers=None) -> WeightsUpdated:
        self.loads.append(weight_version)
        if self.during_load is not None:
            run, self.during_load = self.during_load, None
            await asyncio.to_thread(run)
        self.gate.version = weight_version
        return WeightsUpdated(success=True, weight_version=weight_version, paused_s=0.0)


def test_a_push_rolled_back_while_it_loads_is_refused_and_the_live_weights_come_back(store_factory) -> None:
    store, other_replica = store_factory(), store_factory()
    _ledger(store, None)
    engines = _Engines()
    control = VersionControl(store, engines, safe_updates=False)
    engines.during_load = lambda: other_replica.roll_back("R", "worse")
    with pytest.raises(Conflict) as exc:
        asyncio.run(control.push(Push(model_path="/ckpt/C", weight_version="C", parent="L")))
    assert exc.value.code == "weights_rolled_back" and "parent_version R" in str(exc.value)
    assert engines.loads == ["C", "R"] and engines.gate.version == "R"
    assert states(store) == {"C": "rolled_back", "L": "rolled_back", "R": "live"}
    _assert_consistent(store)
