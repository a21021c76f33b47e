"""Which checkpoints pruning keeps, and what the trainer's lineage remembers between pushes.

Contract (trainer/checkpoint.py ``prune_checkpoints``, trainer/lineage.py): pruning deletes every ``step_*`` folder
but the newest ``keep`` and the protected ones; the lineage protects the checkpoints the policy server can restore
without an operator reaching back to a retired version: the published version's (live or canary) and, while it is a
canary on trial, the live version's it descends from; a rollback leaves only the restored checkpoint; a resume's
re-push of the published version keeps its fallback. The samples trained since the last push are held as a count
and an id range, in constant memory on every rank.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from trainer.checkpoint import prune_checkpoints, step_dir
from trainer.lease_client import Lineage
from trainer.lineage import LINEAGE_FILE, Reload, RunLineage

pytestmark = pytest.mark.unit


def make_steps(out: Path, steps: range) -> None:
    for s in steps:
        step_dir(out, s).mkdir(parents=True)
        (step_dir(out, s) / "trainer_state.json").write_text("{}")


def left(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def test_pruning_keeps_the_newest_and_the_protected(tmp_path):
    out = tmp_path / "run"
    make_steps(out, range(1, 8))
    (out / "ack_state.json").write_text("{}")
    # protected by the resolved path the trainer pushes, or relative; a path outside out_dir changes nothing
    protect = [str(step_dir(out, 1).resolve()), step_dir(out, 3), str(tmp_path / "base-model")]
    deleted = prune_checkpoints(out, 3, protect)
    assert [p.name for p in deleted] == ["step_000002", "step_000004"]
    assert left(out) == ["ack_state.json", "step_000001", "step_000003", "step_000005", "step_000006", "step_000007"]
    # once no longer protected, an old checkpoint goes at the next pruning
    prune_checkpoints(out, 3, [step_dir(out, 3)])
    assert left(out) == ["ack_state.json", "step_000003", "step_000005", "step_000006", "step_000007"]


def test_lineage_protects_the_live_and_the_canary_checkpoints(tmp_path):
    lineage = RunLineage.load(tmp_path)
    assert lineage.restorable() == [] and lineage.push_lineage() == Lineage(None, 0, None, None)

    lineage.remember_push(tmp_path, "1", "/ck/1", on_trial=True)  # canary over weights from elsewhere
    assert lineage.restorable() == ["/ck/1"]
    lineage.remember_push(tmp_path, "2", "/ck/2", on_trial=True)  # 1 was promoted: live while 2 is on trial
    assert lineage.restorable() == ["/ck/2", "/ck/1"]
    lineage.remember_push(tmp_path, "2", "/ck/2", on_trial=True)  # a resume's re-sync of the canary
    assert lineage.restorable() == ["/ck/2", "/ck/1"]
    lineage.remember_push(tmp_path, "3", "/ck/3", on_trial=False)  # safe updates off: 2 retired
    assert lineage.restorable() == ["/ck/3"]
    lineage.remember_push(tmp_path, "4", "/ck/4", on_trial=True)
    assert RunLineage.load(tmp_path) == lineage  # persisted as it is held
    assert json.loads((tmp_path / LINEAGE_FILE).read_text()) == {
        "published": "4",
        "published_checkpoint": "/ck/4",
        "fallback_checkpoint": "/ck/3",
        "reload": None,
    }

    lineage.remember_restored(tmp_path, "3", "/ck/3", step=6)  # the canary dropped: 3 restored
    assert lineage.restorable() == ["/ck/3"]
    assert lineage.reload == Reload(6, "/ck/3") and lineage.reload_due(6) == "/ck/3" and lineage.reload_due(7) is None
    assert RunLineage.load(tmp_path) == lineage


def test_a_lineage_file_without_checkpoints_still_loads(tmp_path):
    (tmp_path / LINEAGE_FILE).write_text(json.dumps({"published": "5", "reload": None}))
    lineage = RunLineage.load(tmp_path)
    assert lineage.push_lineage().parent_version == "5" and lineage.restorable() == []
    lineage.remember_push(tmp_path, "6", "/ck/6", on_trial=True)
    assert lineage.restorable() == ["/ck/6"]


def test_unpublished_samples_take_constant_memory_and_reset_on_each_push(tmp_path):
    lineage = RunLineage()
    lineage.unpublished.add(["s-0005", "s-0002"])
    lineage.unpublished.add([])
    lineage.unpublished.add(["s-0009", "s-0003"])
    assert lineage.push_lineage() == Lineage(None, 4, "s-0002", "s-0009")
    small = len(pickle.dumps(lineage))
    # a long canary trial: every rank admits samples for many steps with no push taken
    ids = ["s-0005", "s-0002", "s-0009", "s-0003"]
    for step in range(2000):
        batch = [f"s-{step:05d}-{i}" for i in range(8)]
        lineage.unpublished.add(batch)
        ids += batch
    assert len(pickle.dumps(lineage)) <= small + 16  # the range's ids grow by a few characters, not by 16,000 ids
    assert lineage.push_lineage() == Lineage(None, len(ids), min(ids), max(ids))
    lineage.remember_push(tmp_path, "1", "/ck/1", on_trial=False)
    assert lineage.push_lineage() == Lineage("1", 0, None, None)
