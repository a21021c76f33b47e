"""The weight-version ledger in the store, on both backends (policy_server.store.versions).

Contract: the engines' weights at startup are recorded live once; a push is a candidate, then canary or live
(the previous live retired); one version is pending at a time (the second push is refused, also from another
connection); a push whose parent is not live is refused (``weights_rolled_back`` when the parent was rolled
back); after a rollback a push must name the restored live version as parent (``parent_required`` for none
or an unknown one) until one naming it has loaded; promote needs a canary; a rollback to an unknown version
is UnknownVersion, to a rolled-back one a conflict; it makes the target live and every newer live, canary or
candidate version rolled_back; the ledger survives a reopen (overlapping changes: test_version_ledger_races.py).
"""

from __future__ import annotations

import time

import pytest

from engine.records import WeightVersion
from policy_server.store import UnknownVersion, VersionConflict

STALE_S = 600.0


def push(version: str, parent: str | None, **kw: object) -> WeightVersion:
    now = time.time()
    return WeightVersion(
        version=version, checkpoint=f"/ckpt/{version}", parent=parent, created_at=now, updated_at=now, **kw
    )


def states(store) -> dict[str, str]:
    return {v.version: v.state for v in store.list_versions()}


def test_ledger_state_machine(store_factory) -> None:
    store = store_factory()
    base = store.ensure_live("default", "/models/base")
    assert (base.version, base.state) == ("default", "live")
    assert store.ensure_live("other", "/x").version == "default"  # recorded once

    got = store.add_version(
        push("1", "default", sample_count=8, sample_id_min="a", sample_id_max="h"), stale_after_s=STALE_S
    )
    assert (got.state, got.sample_count, got.sample_id_min, got.sample_id_max) == ("candidate", 8, "a", "h")
    with pytest.raises(VersionConflict) as exc:  # one pending at a time
        store.add_version(push("2", "default"), stale_after_s=STALE_S)
    assert exc.value.code == "update_in_progress"
    store.finish_push("1", "canary", "loaded")
    with pytest.raises(VersionConflict) as exc:
        store.add_version(push("2", "1"), stale_after_s=STALE_S)
    assert exc.value.code == "canary_in_progress"
    promoted = store.promote("manual")
    assert (promoted.version, promoted.state, promoted.note) == ("1", "live", "manual")
    assert states(store) == {"1": "live", "default": "retired"}
    with pytest.raises(VersionConflict) as exc:
        store.promote("manual")
    assert exc.value.code == "no_canary"

    store.add_version(push("2", "1"), stale_after_s=STALE_S)
    store.finish_push("2", "live", "direct")
    assert states(store) == {"2": "live", "1": "retired", "default": "retired"}
    with pytest.raises(UnknownVersion):
        store.roll_back("nope", "manual")
    changed = store.roll_back("1", "worse")
    assert [(v.version, v.state) for v in changed] == [("1", "live"), ("2", "rolled_back")]
    assert store.rolled_back_versions() == {"2"}
    with pytest.raises(VersionConflict) as exc:
        store.roll_back("2", "manual")
    assert exc.value.code == "not_restorable"

    # the trainer's next push still descends from the rolled-back version: refused until it reloads
    with pytest.raises(VersionConflict) as exc:
        store.add_version(push("3", "2"), stale_after_s=STALE_S)
    assert exc.value.code == "weights_rolled_back"
    with pytest.raises(VersionConflict) as exc:
        store.add_version(push("2", "1"), stale_after_s=STALE_S)
    assert exc.value.code == "version_exists"
    store.add_version(push("3", "1"), stale_after_s=STALE_S)
    store.drop_candidate("3")  # its weights did not load
    assert "3" not in states(store)

    reopened = store_factory()  # a new process (another replica, or after kill -9) reads the same ledger
    assert states(reopened) == {"2": "rolled_back", "1": "live", "default": "retired"}
    assert reopened.version_in_state("live").version == "1"
    assert [v.version for v in reopened.list_versions(limit=2)] == ["2", "1"]  # newest first


def test_concurrent_pushes_one_is_refused(store_factory) -> None:
    first, second = store_factory(), store_factory()  # two connections (two replicas on PostgreSQL)
    first.ensure_live("default", "/models/base")
    first.add_version(push("a", "default"), stale_after_s=STALE_S)
    with pytest.raises(VersionConflict):
        second.add_version(push("b", "default"), stale_after_s=STALE_S)
    # a candidate whose pusher died mid-load does not block pushes for ever
    second.add_version(push("c", "default"), stale_after_s=-1.0)
    assert states(second) == {"c": "candidate", "default": "live"}


def test_pins_and_open_sessions(store_factory) -> None:
    store = store_factory()
    assert store.pin_session("s1", "a") == "a"
    assert store.pin_session("s1", "b") == "a"  # pinned once
    assert store.session_pin("s1") == "a" and store.session_pin("nope") is None
    assert store.open_pinned_sessions("a", active_since=0.0) == 1  # no row yet: its first turn is in flight
    store.touch_session("s1")
    assert store.open_pinned_sessions("a", active_since=0.0) == 1
    assert store.open_pinned_sessions("a", active_since=time.time() + 60) == 0  # idle longer than that
    store.end_session("s1")
    assert store.open_pinned_sessions("a", active_since=0.0) == 0


def test_after_a_rollback_a_push_must_name_the_restored_version(store_factory) -> None:
    """Parentless pushes are accepted until a rollback; from then on only a push naming the restored live version
    (the trainer reloaded it) is, until one such push has loaded; an unknown parent counts as none. The rule is in
    the store, so it survives a reopen and holds at every replica."""
    store = store_factory()
    store.ensure_live("base", "/models/base")
    store.add_version(push("1", None), stale_after_s=STALE_S)  # a trainer that never rolled back
    store.finish_push("1", "canary", "loaded")
    assert not store.get_version("base").parent_required
    store.roll_back("base", "worse")  # drops the canary: the trainer's weights descend from it
    assert store.get_version("base").parent_required

    other = store_factory()  # another replica, or the same one after kill -9
    for parent in (None, "never-recorded"):
        with pytest.raises(VersionConflict) as exc:
            other.add_version(push("2", parent), stale_after_s=STALE_S)
        assert exc.value.code == "parent_required"
        assert "reload" in str(exc.value) and "parent_version base" in str(exc.value)
    with pytest.raises(VersionConflict) as exc:  # still descending from the rolled-back version
        other.add_version(push("2", "1"), stale_after_s=STALE_S)
    assert exc.value.code == "weights_rolled_back"

    other.add_version(push("2", "base"), stale_after_s=STALE_S)  # the trainer reloaded base
    other.drop_candidate("2")  # its weights did not load: nothing descends from base yet
    with pytest.raises(VersionConflict) as exc:
        store.add_version(push("3", None), stale_after_s=STALE_S)
    assert exc.value.code == "parent_required"
    store.add_version(push("3", "base"), stale_after_s=STALE_S)
    store.finish_push("3", "canary", "loaded")
    assert not store.get_version("base").parent_required
    store.promote("better")
    store.add_version(push("4", None), stale_after_s=STALE_S)  # accepted again: the next rollback re-arms it
    store.finish_push("4", "live", "direct")

    store.roll_back("3", "worse")  # a retired version restored: the same rule
    assert store_factory().get_version("3").parent_required
    with pytest.raises(VersionConflict) as exc:
        store.add_version(push("5", None), stale_after_s=STALE_S)
    assert exc.value.code == "parent_required"
    store.add_version(push("5", "3"), stale_after_s=STALE_S)
    store.finish_push("5", "live", "direct")
    assert not store.get_version("3").parent_required and store.get_version("3").state == "retired"
    store.add_version(push("6", None), stale_after_s=STALE_S)
