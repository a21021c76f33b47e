"""No step without a gradient, nothing non-finite past the trainer's door, and the staleness bound.

Contract (trainer/train.py, trainer/update.py): a batch in which every advantage is 0 or every token is masked
runs no optimizer step, writes no checkpoint and publishes no weights; its leases are acked and it is counted
(``skipped_steps.jsonl``, ``skipped_steps`` in metrics.jsonl); Adam's state stays as it was. A sample with an
unusable value (engine.sample_values) is set aside with mask 0 and never turns a weight NaN. With
``--max-staleness K`` a sample generated more than K weight versions before the weights being updated is set
aside as ``stale``. Real tiny model, real training loop, samples from a file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.records import WeightsPushed
from tests.trainer.conftest import write_samples
from trainer.checkpoint import latest_checkpoint
from trainer.lease_client import FileSampleSource
from trainer.settings import TrainConfig
from trainer.train import SKIPPED_STEPS_FILE, train

pytestmark = pytest.mark.slow


class CountingSource(FileSampleSource):
    """FileSampleSource that records acks and weight pushes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.acks: list[str] = []
        self.pushes: list[str] = []

    def ack(self, lease_id: str) -> None:
        super().ack(lease_id)
        self.acks.append(lease_id)

    def update_weights(self, model_path: str, weight_version: str, lineage: object = None) -> WeightsPushed:
        self.pushes.append(weight_version)
        return super().update_weights(model_path, weight_version)


@pytest.fixture(scope="module")
def real_samples(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return write_samples(tiny_model_dir, tmp_path_factory.mktemp("s") / "s.jsonl", 16, seed=3)


def _run(model_dir: Path, out: Path, samples: list[dict], **kw) -> tuple[dict, CountingSource]:
    f = out.parent / f"{out.name}.jsonl"
    f.write_text("".join(json.dumps(s) + "\n" for s in samples))
    src = CountingSource(f, out / "cursor.json")
    cfg = {
        "model_path": str(model_dir),
        "out_dir": str(out),
        "steps": 10,
        "lr": 1e-3,
        "micro_batch_size": 4,
        "progress": False,
        **kw,
    }
    return train(TrainConfig(**cfg), source=src), src


def _skipped(out: Path) -> list[dict]:
    path = out / SKIPPED_STEPS_FILE
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _assert_untouched(model_dir: Path, out: Path, src: CountingSource) -> None:
    assert latest_checkpoint(out) is None and not list(out.glob("step_*")), "a skipped step wrote a checkpoint"
    assert src.pushes == [], "a skipped step published weights"
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


def test_batch_mean_on_a_lone_sample_is_no_step(tiny_model_dir, tmp_path, real_samples):
    lone = [dict(real_samples[0], reward=1.0, has_reward=True)]
    result, src = _run(tiny_model_dir, tmp_path / "run", lone, batch_size=1, baseline="batch_mean")
    assert result["step"] == 0 and result["checkpoint"] is None
    _assert_untouched(tiny_model_dir, tmp_path / "run", src)
    assert len(src.acks) == 1 and src.acked == 1, "the skipped step's lease was not acked"
    assert [s["n_samples"] for s in _skipped(tmp_path / "run")] == [1]


def test_running_mean_equal_to_the_reward_is_no_step_and_adam_state_is_kept(tiny_model_dir, tmp_path, real_samples):
    """Lone samples with rewards 1, 1, then -1: the first two have A = 0 (no history: own mean; then b = 1),
    the third A = -1 - 1 = -2. One optimizer step in all: Adam's step count is 1, not 3."""
    seq = [dict(real_samples[i], reward=r, has_reward=True) for i, r in enumerate((1.0, 1.0, -1.0))]
    out = tmp_path / "run"
    result, src = _run(tiny_model_dir, out, seq, batch_size=1, baseline="running_mean", ppo_epochs=1)
    assert result["step"] == 1 and len(_skipped(out)) == 2
    assert src.pushes == ["1"] and len(src.acks) == 3 and src.acked == 3
    optim = torch.load(latest_checkpoint(out) / "optimizer.pt", weights_only=False)
    assert {float(st["step"]) for st in optim["optimizer"]["state"].values()} == {1.0}
    [line] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["skipped_steps"] == 2 and line["rl_adv_nonzero"] == 1


def test_only_truncated_replies_under_mask_no_eos_is_no_step(tiny_model_dir, tmp_path, real_samples):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    truncated = []
    for s in real_samples[:2]:
        ids = list(s["response_ids"])
        ids[-1] = ids[-1] if ids[-1] != eos else eos + 1
        truncated.append(dict(s, response_ids=ids, reward=1.0, has_reward=True))
    out = tmp_path / "run"
    result, src = _run(tiny_model_dir, out, truncated, batch_size=2, baseline="none", mask_no_eos_with_zero=True)
    assert result["step"] == 0
    _assert_untouched(tiny_model_dir, out, src)
    assert src.acked == 2 and len(_skipped(out)) == 1


POISONS = [
    {"w_rl": math.nan},
    {"w_rl": None},
    {"w_opd": math.inf},
    {"reward": math.nan},
    {"token_rewards": "fill-inf"},
    {"teacher_temperature": 0.6},
    {"rollout_logprobs": "fill-nan"},
]


def test_a_poisoned_samples_file_trains_as_if_the_poison_were_absent(tiny_model_dir, tmp_path, real_samples):
    good = real_samples[:8]
    poisoned = []
    for i, over in enumerate(POISONS):
        s = dict(real_samples[8 + i], sample_id=f"poison-{i}")
        n = len(s["response_ids"])
        for k, v in over.items():
            s[k] = [math.inf] * n if v == "fill-inf" else [math.nan] * n if v == "fill-nan" else v
        poisoned.append(s)
    runs = {}
    for name, batch in (("clean", good), ("poisoned", good + poisoned)):
        out = tmp_path / name
        _run(tiny_model_dir, out, batch, batch_size=len(batch), steps=1, baseline="none")
        metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        runs[name] = (metrics, load_file(str(out / "step_000001" / "model.safetensors")))
    (mc, wc), (mp, wp) = runs["clean"], runs["poisoned"]
    assert mp["n_invalid"] == len(POISONS) and mp["n_learning_samples"] == mc["n_learning_samples"] == 8
    # Bit-identical, not close: the 8 good samples fill the same two micro-batches of 4 in both runs and the
    # poisoned ones only add micro-batches whose every token is masked (exact zeros in the loss and gradients).
    assert math.isfinite(mp["loss"]) and mp["loss"] == mc["loss"]
    for k, v in wc.items():
        assert torch.isfinite(wp[k]).all(), f"{k} went non-finite"
        assert torch.equal(wp[k], v), k


def test_max_staleness_sets_old_samples_aside(tiny_model_dir, tmp_path, real_samples):
    """Every sample comes from the initial weights (version 'default' = 0). With K = 1 the step-1 and step-2
    batches are fresh enough (age 0, 1); at step 2 the third batch is 2 versions old: set aside, no step."""
    samples = [dict(s, weight_version="default") for s in real_samples[:12]]
    out = tmp_path / "run"
    result, src = _run(tiny_model_dir, out, samples, batch_size=4, max_staleness=1, baseline="none")
    assert result["step"] == 2 and src.pushes == ["1", "2"] and len(src.acks) == 3 and src.acked == 12
    [skipped] = _skipped(out)
    assert skipped["n_stale"] == 4 and skipped["after_step"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["n_stale"] for m in lines] == [0, 0]


def test_a_samples_file_has_no_staleness_bound(tiny_model_dir, tmp_path, real_samples):
    """Offline data: the file's versions are not this trainer's, so nothing is set aside as stale."""
    samples = [dict(s, weight_version="default") for s in real_samples[:12]]
    out = tmp_path / "run"
    f = tmp_path / "run.jsonl"  # where _run writes them
    result, _ = _run(tiny_model_dir, out, samples, batch_size=4, max_staleness=0, baseline="none", samples_file=str(f))
    assert result["step"] == 3 and _skipped(out) == []
