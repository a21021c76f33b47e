"""The lease client package (trainer/lease_client/): importable alone, typed samples, staleness, step batches;
and a leased sample as per-sample tensors (trainer/sample_tensors.py). Its HTTP half is tested in test_policy_client.py and test_collect_leases.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.records import Sample
from tests.trainer.conftest import rl_sample

# The package's exported names on purpose: the test pins its public API.
from trainer.lease_client import (
    FileSampleSource,
    Lease,
    iter_batches,
    leased_batch,
    oldest_version,
    staleness,
    typed_samples,
    version_number,
)
from trainer.sample_tensors import SampleUnusable, sample_tensors

pytestmark = pytest.mark.unit


@pytest.mark.process
def test_imports_alone_without_torch_or_servers() -> None:
    code = (
        "import sys, trainer.lease_client as lc; "
        "heavy = [m for m in ('torch', 'fastapi', 'policy_server', 'judge_server', 'transformers') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_typed_samples_sets_aside_what_breaks_the_schema() -> None:
    good = rl_sample("a", weight_version="3")
    bad = rl_sample("b", reward="high")
    ok, aside = typed_samples([good, bad])
    assert [s.sample_id for s in ok] == ["a"]
    assert isinstance(ok[0], Sample) and ok[0].reward == 1.0 and ok[0].weight_version == "3"
    assert [a.sample_id for a in aside] == ["b"]
    assert "reward" in aside[0].reason


@pytest.mark.parametrize(
    ("fields", "current", "expected"),
    [
        ({"weight_version": "3"}, 5, 2),
        ({"weight_version": "3"}, "3", 0),
        ({"weight_version": "4", "weight_versions": ["3", "4"]}, 6, 3),  # the oldest version behind the reply
        ({"weight_version": "abc"}, 5, None),  # a named version has no staleness, never 0
        ({"weight_version": None}, 5, None),
        ({"weight_version": "3"}, "latest", None),
        ({"weight_version": "3", "weight_versions": ["x", "3"]}, 5, None),  # an unknown part: unknown, not 2
    ],
)
def test_staleness(fields: dict, current: object, expected: int | None) -> None:
    s = Sample.model_validate(rl_sample(**fields))
    assert staleness(s, current) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"weight_version": "default"}, 5),  # the engine's initial weights, as the embedded trainer reads them
        ({"weight_version": None}, 5),
        ({"weight_version": "default", "weight_versions": ["default", "2"]}, 5),  # the oldest part counts
        ({"weight_version": "2", "weight_versions": ["2", "4"]}, 3),
    ],
)
def test_staleness_with_a_known_initial_version(fields: dict, expected: int) -> None:
    """One rule for both callers: the trainer only says which number a non-integer version stands for."""
    s = Sample.model_validate(rl_sample(**fields))
    assert staleness(s, 5, initial_version=0) == expected
    assert staleness(s, 5) == (None if expected == 5 else expected)


def test_version_numbers() -> None:
    assert version_number(" 12 ") == 12
    assert version_number("v12") is None
    assert oldest_version(Sample.model_validate(rl_sample(weight_versions=["9", "11", "7"]))) == 7
    assert oldest_version(Sample.model_validate(rl_sample(weight_versions=["9", "x", "7"]))) is None
    assert oldest_version(Sample.model_validate(rl_sample(weight_versions=["9", "x", "7"])), initial_version=0) == 0


def test_iter_batches_steps_and_acks(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    rows = [rl_sample(f"s{i}") for i in range(5)] + [rl_sample("broken", response_ids="x")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = FileSampleSource(path, tmp_path / "state.json")
    batches = []
    for b in iter_batches(src, 4, wait_s=0.0):
        batches.append(([s.sample_id for s in b.samples], [a.sample_id for a in b.set_aside]))
        b.ack()
    assert batches == [(["s0", "s1", "s2", "s3"], []), (["s4"], ["broken"])]
    assert json.loads((tmp_path / "state.json").read_text()) == {"acked": 6}


def test_leased_batch_merges_prm_windows() -> None:
    a = Lease("l1", [rl_sample("x")], prm_metrics={"m": 1.0})
    b = Lease("l2", [rl_sample("y")], prm_metrics={"m": 2.0, "n": 3.0})
    got = leased_batch(FileSampleSource.__new__(FileSampleSource), [a, b])
    assert got.lease_ids == ["l1", "l2"] and got.prm_metrics == {"m": 2.0, "n": 3.0}


def test_sample_tensors_values() -> None:
    s = Sample.model_validate(
        rl_sample(
            prompt_ids=[1, 2, 3],
            response_ids=[7, 8, 9],
            rollout_logprobs=[-1.0, -0.5, -0.25],
            loss_mask=[1, 1, 0],
            reward=-1.0,
            token_rewards=[0.5, 0.0, 0.25],
            has_teacher=True,
            teacher_logprobs=[-0.5, -1.5, -0.25],
            weight_versions=["2", "3"],
        )
    )
    t = sample_tensors(s)
    assert t.prompt_ids.tolist() == [1, 2, 3] and t.response_ids.dtype == torch.long
    assert t.loss_mask.tolist() == [1, 1, 0]
    assert t.token_level_rewards.tolist() == [0.5, 0.0, -0.75]  # reward -1 on the last token + process rewards
    assert t.process_rewards is not None and t.process_rewards.tolist() == [0.5, 0.0, 0.25]
    assert t.opd_advantages is not None and t.opd_advantages.tolist() == [0.5, -1.0, 0.0]  # 0 off the mask
    assert t.reward == -1.0 and t.has_reward and t.oldest_version == 2


def test_sample_tensors_without_signals() -> None:
    t = sample_tensors(Sample.model_validate(rl_sample(reward=None, has_reward=False)))
    assert t.reward is None and not t.has_reward and t.token_level_rewards.tolist() == [0.0, 0.0]
    assert t.teacher_logprobs is None and t.opd_advantages is None


def test_sample_tensors_refuses_a_broken_sample() -> None:
    with pytest.raises(SampleUnusable, match="rollout_logprobs has 1 entries for 2 response ids"):
        sample_tensors(Sample.model_validate(rl_sample("z", rollout_logprobs=[-1.0])))
