"""After a rollback the trainer restarts from the restored weights (trainer/train.py ``publish``/``reload_if``).

Contract: each push names the version it descends from and the samples trained since (count, id range);
a push the server defers (a canary on trial) leaves the weights unpublished and the next push carries the
samples of both steps; a push refused because its parent was rolled back reloads the restored checkpoint
(the weights become exactly its weights, Adam's moments are cleared) and the next push descends from the
restored version; a resume after such a refusal (before the next checkpoint) reloads again instead of
pushing the rejected weights; a sample flagged ``rolled_back`` is trained with mask 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from engine.records import Sample, WeightsPushed, WeightVersion
from tests.trainer.test_loop import cfg_for
from trainer.lease_client import FileSampleSource, Lineage, PublishDeferred, WeightsRolledBack
from trainer.lineage import LINEAGE_FILE
from trainer.start import load_policy, reload_weights
from trainer.train import rolled_back_problem, train

pytestmark = pytest.mark.slow


class LedgerSource(FileSampleSource):
    """Answers each push as scripted: "ok", "defer" (a canary on trial) or "rolled_back" (restore ``base``)."""

    def __init__(self, *a, script: list[str], base: Path, **kw):
        super().__init__(*a, **kw)
        self.script, self.base = script, base
        self.pushes: list[tuple[str, Lineage | None]] = []

    def update_weights(self, model_path: str, weight_version: str, lineage: Lineage | None = None) -> WeightsPushed:
        self.pushes.append((weight_version, lineage))
        answer = self.script.pop(0) if self.script else "ok"
        if answer == "defer":
            raise PublishDeferred("version 1 is canary")
        if answer == "rolled_back":
            now = time.time()
            live = WeightVersion(
                version="base", checkpoint=str(self.base), state="live", created_at=now, updated_at=now
            )
            raise WeightsRolledBack("parent rolled back", live)
        return super().update_weights(model_path, weight_version)


def test_push_lineage_defer_and_reload(tiny_model_dir, sample_file, tmp_path):
    out = tmp_path / "run"
    src = LedgerSource(sample_file, out / "cursor.json", script=["ok", "defer", "rolled_back"], base=tiny_model_dir)
    train(cfg_for(tiny_model_dir, out, steps=3, batch_size=4), source=src)
    (v1, l1), (v2, l2), (v3, l3) = src.pushes[:3]
    assert (v1, l1.parent_version, l1.sample_count) == ("1", None, 4)
    assert l1.sample_id_min <= l1.sample_id_max
    assert (v2, l2.parent_version, l2.sample_count) == ("2", "1", 4)
    assert (v3, l3.parent_version, l3.sample_count) == ("3", "1", 8)  # step 2 was never published
    lineage = json.loads((out / LINEAGE_FILE).read_text())
    reload = {"step": 3, "checkpoint": str(tiny_model_dir)}
    assert lineage == {
        "published": "base",
        "published_checkpoint": str(tiny_model_dir),
        "fallback_checkpoint": None,
        "reload": reload,
    }

    # a crash right after the refusal: the step-3 checkpoint holds the rejected weights; the resume reloads
    resumed = LedgerSource(sample_file, out / "cursor.json", script=[], base=tiny_model_dir)
    train(cfg_for(tiny_model_dir, out, steps=4, batch_size=4), source=resumed)
    assert [(v, lin.parent_version) for v, lin in resumed.pushes] == [("4", "base")]


def test_reload_weights_restores_exactly_and_clears_adam(tiny_model_dir, tmp_path):
    cfg = cfg_for(tiny_model_dir, tmp_path / "run")
    policy = load_policy(cfg, None, torch.device("cpu"), 1)
    base = {k: v.clone() for k, v in policy.model.state_dict().items()}
    loss = sum(p.sum() for p in policy.model.parameters())
    loss.backward()
    policy.opt.step()
    assert policy.opt.state and any(not torch.equal(base[k], v) for k, v in policy.model.state_dict().items())
    reload_weights(policy, tiny_model_dir, 1)
    assert all(torch.equal(base[k], v) for k, v in policy.model.state_dict().items())
    assert not policy.opt.state


@pytest.mark.unit
def test_rolled_back_samples_are_set_aside():
    assert rolled_back_problem(Sample(weight_version="7", rolled_back=True)) == "made by rolled-back weight version 7"
    assert rolled_back_problem(Sample(weight_version="7")) is None
