"""The old log-probs of an on-policy step come from the update's own forward (trainer/old_pass.py).

Contract: with one PPO epoch, one minibatch and one micro-batch per rank, ``--old-logprob-pass auto`` (the default)
runs ONE forward per step, where ``separate`` runs a no-grad pass and then the update's forward; both move the
weights the same way and report the same statistics (PPO ratio, train-vs-rollout gap, rollout importance weights,
mis rejection), whatever the off-policy correction. A second epoch, a second micro-batch or a model with dropout
keeps the separate pass. The two paths run the same float32 operations in another autograd mode, so they are
compared with ``tests.numerics.reorder_atol`` for the step's reductions, never a constant tuned on one machine.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.records import Sample
from tests.numerics import assert_reordered_close, forward_terms, reorder_atol
from tests.trainer.conftest import records, train_config
from trainer.advantages import RunningMean
from trainer.old_pass import fuses_old_pass, has_dropout
from trainer.update import plan_minibatches, train_on_batch

COMPARED = ("loss", "pg_loss", "approx_kl", "adv_mean", "train_rollout_lp_abs_diff", "rollout_is_mean", "entropy")


def _samples(n: int = 6) -> list[Sample]:
    """Combine-mode samples (a reward and teacher log-probs each); every third one from a much hotter behaviour
    (rollout log-probs 4 below the model's), so mis rejects its tokens and tis truncates their weights."""
    rng = random.Random(3)
    raw = []
    for i in range(n):
        resp = [rng.randrange(10, 1000) for _ in range(rng.randint(3, 7))]
        raw.append(
            {
                "sample_id": f"s{i}",
                "session_id": f"sess{i}",
                "turn_index": 0,
                "mode": "combine",
                "prompt_ids": [rng.randrange(10, 1000) for _ in range(rng.randint(8, 30))],
                "response_ids": resp,
                "rollout_logprobs": [-rng.uniform(6, 8) - (4.0 if i % 3 == 0 else 0.0) for _ in resp],
                "loss_mask": [1] * len(resp),
                "reward": rng.choice([1.0, -1.0]),
                "has_reward": True,
                "teacher_logprobs": [-rng.uniform(1, 9) for _ in resp],
                "has_teacher": True,
                "w_rl": 0.5,
                "w_opd": 2.0,
            }
        )
    return records(raw)


def _step(model_dir: Path, samples: list[Sample], **settings: object) -> tuple[list[torch.Tensor], dict, int]:
    """One train_on_batch from the model's initial weights (SGD at lr 1, so a difference in the gradient shows in
    the weights undivided): the weights after it, its metrics, and how many forward passes it ran."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = train_config(max_grad_norm=0.0, baseline="none", **settings)
    metrics = train_on_batch(
        model, model, None, opt, samples, [False] * len(samples), cfg, RunningMean(0.9), 0, 1, torch.device("cpu"), None
    )
    assert metrics is not None
    return [p.detach().clone() for p in model.parameters()], metrics, len(forwards)


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_an_on_policy_step_runs_one_forward_and_trains_as_the_separate_pass(tiny_model_dir: Path, correction: str):
    samples = _samples()
    on_policy = {"ppo_epochs": 1, "micro_batch_size": len(samples), "rollout_correction": correction}
    w_fused, m_fused, n_fused = _step(tiny_model_dir, samples, **on_policy)
    w_sep, m_sep, n_sep = _step(tiny_model_dir, samples, old_logprob_pass="separate", **on_policy)
    assert (n_fused, n_sep) == (1, 2)
    if correction == "mis":
        assert m_fused["rollout_is_masked_frac"] == m_sep["rollout_is_masked_frac"] > 0.2  # the hot third
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    total = forward_terms(config, tokens) + tokens
    for key in COMPARED:
        scale = max(abs(m_sep[key]), m_sep["adv_abs_mean"], 1.0)
        assert m_fused[key] == pytest.approx(m_sep[key], abs=reorder_atol(total, scale)), key
    for i, (a, b) in enumerate(zip(w_sep, w_fused, strict=True)):
        assert_reordered_close(b, a, n_terms=total, msg=f"parameter {i}")


def test_a_step_that_is_not_on_policy_keeps_the_separate_pass(tiny_model_dir: Path) -> None:
    samples = _samples()
    # two epochs: the second starts from updated weights, so the old log-probs must come from before the first
    assert _step(tiny_model_dir, samples, ppo_epochs=2, micro_batch_size=len(samples))[2] == 1 + 2
    # two micro-batches: the first's backward would run before the second's old log-probs were known
    assert _step(tiny_model_dir, samples, ppo_epochs=1, micro_batch_size=len(samples) // 2)[2] == 2 + 2


@pytest.mark.unit
def test_dropout_or_a_second_minibatch_keeps_the_separate_pass() -> None:
    class Net(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.drop = torch.nn.Dropout(p)

    class Configured(torch.nn.Module):
        config = type("Config", (), {"attention_dropout": 0.1})()

    assert not has_dropout(Net(0.0)) and has_dropout(Net(0.1)) and has_dropout(Configured())
    samples = _samples(4)
    cfg = train_config(ppo_epochs=1, micro_batch_size=4)
    plan = plan_minibatches(samples, [False] * 4, cfg, 0, 1, torch.device("cpu"), None)
    assert fuses_old_pass(Net(0.0), plan, cfg)
    assert not fuses_old_pass(Net(0.1), plan, cfg)
    assert not fuses_old_pass(
        Net(0.0), plan, train_config(ppo_epochs=1, micro_batch_size=4, old_logprob_pass="separate")
    )
    two = train_config(ppo_epochs=1, micro_batch_size=4, minibatches=2)
    assert not fuses_old_pass(
        Net(0.0), plan_minibatches(samples, [False] * 4, two, 0, 1, torch.device("cpu"), None), two
    )
