"""The trainer's measured defaults (docs/REWARD_MODES.md "Defaults, measured") and how min-batch resolves."""

from __future__ import annotations

import pytest

from trainer.settings import TrainConfig

pytestmark = pytest.mark.unit


def cfg(**kw: object) -> TrainConfig:
    return TrainConfig(model_path="m", out_dir="o", **kw)


def test_the_closed_loop_winners_are_the_defaults():
    c = cfg()
    assert (c.min_batch_size, c.batch_size, c.ppo_epochs, c.minibatches) == (4, 8, 2, 1)
    assert (c.baseline, c.max_staleness) == ("running_mean", 4)


def test_the_default_min_batch_is_capped_at_the_batch_size_an_explicit_one_is_checked():
    assert cfg(batch_size=2).min_batch_size == 2
    cfg(batch_size=2).check_consistency()
    assert cfg(min_batch=0, batch_size=6).min_batch_size == 6
    with pytest.raises(ValueError, match="min_batch must be in"):
        cfg(batch_size=2, min_batch=3).check_consistency()
    with pytest.raises(ValueError, match="max_staleness"):
        cfg(max_staleness=-2).check_consistency()
