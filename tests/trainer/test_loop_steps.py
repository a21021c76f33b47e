"""The named steps of the trainer loop as pure pieces (no model): minibatch planning, denominators after mis
rejection, which samples are trained, the PRM-window fold and the no-learning-term skip.

Expectations are derived by hand: minibatch m of M takes samples m, m + M, ...; rank r of W takes every W-th of
those; every rank runs as many micro-batches as the rank with the largest share, padding with zero-mask dummy rows.
"""

from __future__ import annotations

import torch

from tests.trainer.conftest import rl_record, train_config
from trainer.train import AdmittedBatch, PrmWindows
from trainer.update import classify_samples, count_after_rejection, plan_minibatches, sample_rewards


def test_minibatches_interleave_samples_and_ranks_pad_with_dummy_rows():
    samples = [rl_record(str(i)) for i in range(5)]
    cfg = train_config(minibatches=2, micro_batch_size=1)
    # minibatch 0 = samples 0, 2, 4; minibatch 1 = samples 1, 3. World 2: rank 1 holds 2 of mb 0, 3 of mb 1.
    plan = plan_minibatches(samples, [False] * 5, cfg, rank=1, world=2, device=torch.device("cpu"), eos_id=None)
    assert [[m.sample_index for m in mb.micros] for mb in plan] == [[[2], [-1]], [[3]]]
    # global denominators: 2 valid tokens per sample, over the whole minibatch (every rank's share)
    assert [(mb.num_tokens, mb.num_seqs) for mb in plan] == [(6.0, 3.0), (4.0, 2.0)]
    dummy = plan[0].micros[1].batch
    assert float(dummy.mask.sum()) == 0.0  # a dummy row never adds to any loss term


def test_a_live_step_with_fewer_samples_than_minibatches_has_one_minibatch_per_sample():
    cfg = train_config(minibatches=2, micro_batch_size=4)
    plan = plan_minibatches([rl_record("a")], [False], cfg, rank=0, world=1, device=torch.device("cpu"), eos_id=None)
    assert [[m.sample_index for m in mb.micros] for mb in plan] == [[[0]]]
    assert [(mb.num_tokens, mb.num_seqs) for mb in plan] == [(2.0, 1.0)]


def test_idle_samples_keep_their_rows_but_leave_the_denominators():
    samples = [rl_record("a"), rl_record("b"), rl_record("c")]
    plan = plan_minibatches(
        samples,
        [False, True, False],
        train_config(micro_batch_size=4),
        rank=0,
        world=1,
        device=torch.device("cpu"),
        eos_id=None,
    )
    [mb] = plan
    assert [m.sample_index for m in mb.micros] == [[0, 1, 2]]
    assert (mb.num_tokens, mb.num_seqs) == (4.0, 2.0)
    assert mb.micros[0].batch.mask.sum(-1).tolist() == [2.0, 0.0, 2.0]


def test_mis_rejection_replaces_the_denominators_only():
    samples = [rl_record("a"), rl_record("b")]
    plan = plan_minibatches(
        samples, [False, False], train_config(minibatches=2), rank=0, world=1, device=torch.device("cpu"), eos_id=None
    )
    counts = torch.tensor([[1.0, 1.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    after = count_after_rejection(plan, counts)
    assert [(mb.num_tokens, mb.num_seqs) for mb in after] == [(1.0, 1.0), (2.0, 1.0)]
    assert [mb.micros for mb in after] == [mb.micros for mb in plan]


def test_trained_and_rewarded_samples():
    samples = [
        rl_record("ok"),
        rl_record("bad"),
        rl_record("masked", loss_mask=[0, 0]),
        rl_record("no-reward", reward=None, has_reward=False),
    ]
    trainable, idle = classify_samples(samples, [False, True, False, False], train_config(), eos_id=None)
    assert trainable.tolist() == [True, False, False, True]
    # idle: invalid, no trained token (all-zero loss mask), or no learning term (no reward in rl mode)
    assert idle == [False, True, True, True]
    rewards, has_reward = sample_rewards(samples, trainable)  # a sample that is not trained is not read
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and has_reward.tolist() == [True, False, False, False]


def test_no_eos_samples_are_not_trained_when_masked():
    samples = [rl_record("eos", response_ids=[7, 2]), rl_record("cut", response_ids=[7, 8])]
    trainable, _ = classify_samples(samples, [False, False], train_config(mask_no_eos_with_zero=True), eos_id=2)
    assert trainable.tolist() == [True, False]


def test_prm_windows_fold_until_the_next_logged_step():
    windows = PrmWindows()
    assert windows.drain() == {}
    windows.add({"rollout/prm_a": 1.0, "rollout/prm_b": 2.0})
    windows.add({"rollout/prm_b": 3.0})  # a later window's value wins
    assert windows.drain() == {"rollout/prm_a": 1.0, "rollout/prm_b": 3.0, "prm_metrics_windows": 2}
    assert windows.drain() == {}


def test_a_batch_without_any_learning_term_is_no_step():
    cfg = train_config()
    assert AdmittedBatch([rl_record("a"), rl_record("b")], [False, True]).has_learning_term(cfg)
    assert not AdmittedBatch([rl_record("a"), rl_record("b")], [True, True]).has_learning_term(cfg)
    assert not AdmittedBatch([rl_record("a", reward=None, has_reward=False)], [False]).has_learning_term(cfg)
