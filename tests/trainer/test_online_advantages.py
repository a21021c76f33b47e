"""Advantages that still learn on live traffic, against hand-derived values.

Contracts (trainer/baselines.py, trainer/advantages.py, trainer/objective.py, docs/REWARD_MODES.md):
single-sample and equal-reward steps under every baseline; normalisation never divides by eps; the running
baselines persist; multiplicative signs in right / neutral / wrong steps (and the literal opt-in); which
samples carry a learning term (denominators, the top-K term's own); the OPD term at T = 1; non-finite values
rejected by the trainer.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.records import Sample
from tests.trainer.conftest import rl_record, rl_sample, train_config
from trainer.advantages import multiplicative_opd, multiplicative_opd_literal, turn_steps
from trainer.baselines import RunningMean, rl_sample_advantages
from trainer.batch import check_sample, collate
from trainer.lease_client import typed_samples
from trainer.objective import carries_learning_term, old_logprobs
from trainer.settings import TrainConfig

T = torch.tensor


def close(a: torch.Tensor, b: list) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=1e-6, rtol=1e-6)


def history(kind: str, rewards: list[float]) -> RunningMean | None:
    """A running baseline that has seen ``rewards`` (momentum 0.5, window K = 2); None for the batch baselines."""
    if kind not in ("running_mean", "window"):
        return None
    rm = RunningMean(momentum=0.5, window=2 if kind == "window" else 0)
    rm.update(rewards)
    return rm


# EMA(0.5) of 0, 0, 0 = 0; window(2) of 0, 0 = 0: a single +1 differs from recent rewards by 1.
@pytest.mark.parametrize(
    "kind, expected",
    [("running_mean", 1.0), ("window", 1.0), ("batch_mean", 0.0), ("batch_mean_loo", 0.0), ("none", 1.0)],
)
def test_single_sample_step(kind, expected):
    adv = rl_sample_advantages(T([1.0]), T([True]), baseline=kind, running=history(kind, [0.0, 0.0, 0.0]))
    close(adv, [expected])


# EMA(0.5) of 0, 0.4 = 0.5*0 + 0.5*0.4 = 0.2; window(2) of 0, 0.4 = 0.2. Four +1: 1 - 0.2 = 0.8 each.
@pytest.mark.parametrize(
    "kind, expected",
    [("running_mean", 0.8), ("window", 0.8), ("batch_mean", 0.0), ("batch_mean_loo", 0.0), ("none", 1.0)],
)
def test_equal_reward_step(kind, expected):
    adv = rl_sample_advantages(T([1.0] * 4), T([True] * 4), baseline=kind, running=history(kind, [0.0, 0.4]))
    close(adv, [expected] * 4)


@pytest.mark.parametrize("kind", ["running_mean", "window", "batch_mean", "batch_mean_loo", "none"])
def test_zero_std_normalisation_never_divides_by_eps(kind):
    # zero-std cases: one +1 under `none`, and four +1 against a running mean of 0.2, must stay O(1), not ~1/eps
    one = rl_sample_advantages(T([1.0]), T([True]), baseline=kind, normalize=True, running=history(kind, [0.0, 0.0]))
    four = rl_sample_advantages(
        T([1.0] * 4), T([True] * 4), baseline=kind, normalize=True, running=history(kind, [0.0, 0.4])
    )
    assert float(one.abs().max()) <= 1.0 and float(four.abs().max()) <= 1.0
    if kind == "none":
        close(one, [1.0])
    if kind == "running_mean":
        close(four, [0.8] * 4)


def test_normalisation_with_spread_divides_by_std():
    # 4, 0 -> centred 2, -2 -> population std 2 -> 1, -1
    close(rl_sample_advantages(T([4.0, 0.0]), T([True, True]), baseline="batch_mean", normalize=True), [1.0, -1.0])


def test_leave_one_out():
    # rewards 1, 0, 0: baselines (0+0)/2 = 0, (1+0)/2 = 0.5, 0.5 -> A = 1, -0.5, -0.5; no reward -> 0
    close(
        rl_sample_advantages(T([1.0, 0.0, 0.0, 9.0]), T([True, True, True, False]), baseline="batch_mean_loo"),
        [1.0, -0.5, -0.5, 0.0],
    )


def test_running_baselines_update_per_sample_and_round_trip():
    ema = RunningMean(momentum=0.5)
    rl_sample_advantages(T([1.0, 0.0, 3.0]), T([True, False, True]), baseline="running_mean", running=ema)
    assert ema.count == 2 and ema.value == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)  # the unrewarded one is skipped
    win = RunningMean(window=2)
    for r in (1.0, 2.0, 6.0):
        rl_sample_advantages(T([r]), T([True]), baseline="window", running=win)
    assert win.recent == [2.0, 6.0] and win.mean() == pytest.approx(4.0)
    back = RunningMean.from_state(win.state_dict(), momentum=0.9, window=2)
    assert back.mean() == pytest.approx(4.0) and back.count == 3
    old_format = RunningMean.from_state({"momentum": 0.9, "value": 0.25, "count": 4}, momentum=0.9, window=0)
    assert old_format.mean() == pytest.approx(0.25)  # a checkpoint written before the window existed
    with pytest.raises(ValueError):
        rl_sample_advantages(T([1.0]), T([True]), baseline="window", running=RunningMean())


def test_multiplicative_signs_right_neutral_wrong():
    # d = teacher - old per token; rows: right step (+1), neutral (0), wrong (-1), wrong scaled (-0.5), no verdict
    teacher = T([[-1.0, -2.0]] * 5)
    old = T([[-1.5, -1.5], [-1.5, -1.5], [-3.0, -1.0], [-3.0, -1.0], [-1.5, -1.5]])
    d = teacher - old  # [0.5, -0.5], [0.5, -0.5], [2, -1], [2, -1], [0.5, -0.5]
    step_ids, scores = turn_steps(torch.ones(5, 2), T([1.0, 0.0, -1.0, -0.5, math.nan]))
    adv = multiplicative_opd(teacher, old, step_ids, scores)
    close(adv, [[0.5, -0.5], [0.0, 0.0], [-2.0, -1.0], [-1.0, -0.5], [0.0, 0.0]])
    assert float(adv[2:4].max()) <= 0.0  # every token of a wrong step is non-positive
    # teacher -3, old -1, PRM -1: the literal product reinforces (+2); the sign-aware form penalises (-2)
    one = turn_steps(torch.ones(1, 1), T([-1.0]))
    assert float(multiplicative_opd_literal(T([[-3.0]]), T([[-1.0]]), *one)) == pytest.approx(2.0)
    assert float(multiplicative_opd(T([[-3.0]]), T([[-1.0]]), *one)) == pytest.approx(-2.0)
    close(multiplicative_opd_literal(teacher, old, step_ids, scores)[:4], d[:4] * T([[1.0], [0.0], [-1.0], [-0.5]]))


def test_which_samples_carry_a_learning_term():
    promoted = rl_record(reward=0.0)  # an at-least-one promoted turn: reward 0
    assert not carries_learning_term(
        promoted, train_config(baseline="none")
    )  # r - 0 = 0: no term, no denominator share
    assert carries_learning_term(promoted, train_config(baseline="running_mean"))  # 0 - b is a real term
    no_reward = rl_record(reward=None, has_reward=False)
    assert not carries_learning_term(no_reward, train_config())
    teacher = [-0.5, -0.5]
    assert carries_learning_term(rl_record(mode="opd", has_teacher=True, teacher_logprobs=teacher), train_config())
    assert not carries_learning_term(rl_record(mode="opd"), train_config())
    for mode in ("prm_gated_opd", "multiplicative", "multiplicative_literal"):
        assert not carries_learning_term(rl_record(), train_config(advantage_mode=mode))  # reward but no teacher
        assert not carries_learning_term(
            rl_record(reward=None, has_reward=False, has_teacher=True), train_config(advantage_mode=mode)
        )
        assert carries_learning_term(
            rl_record(has_teacher=True, teacher_logprobs=teacher), train_config(advantage_mode=mode)
        )
    assert not carries_learning_term(
        rl_record(mode="combine", w_rl=0.0), train_config()
    )  # reward weighted 0, no teacher
    assert carries_learning_term(
        rl_record(reward=None, has_reward=False, teacher_topk={"ids": [[1]], "logprobs": [[-0.1]]}),
        train_config(topk_coef=0.1),
    )


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"reward": math.nan}, "reward is not a finite number"),
        ({"has_teacher": True, "teacher_logprobs": [-0.1, math.inf]}, "teacher_logprobs holds a non-finite"),
        ({"has_teacher": True, "teacher_logprobs": [-0.1, 0.3]}, "teacher_logprobs holds a positive"),
        ({"token_rewards": [0.0, math.nan]}, "token_rewards holds a non-finite"),
    ],
)
def test_trainer_rejects_unusable_values(bad, why):
    assert check_sample(rl_record()) is None
    assert check_sample(rl_record(**bad)).startswith(why)


def test_a_value_of_the_wrong_type_is_set_aside_where_the_lease_is_read():
    typed, aside = typed_samples([rl_sample("a"), rl_sample("b", reward="1.0")])
    assert [s.sample_id for s in typed] == ["a"]
    assert [(a.sample_id, a.reason.split(":")[:2]) for a in aside] == [("b", ["off the Sample schema", " reward"])]


@pytest.mark.slow
def test_opd_old_logprobs_are_at_temperature_one(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    rollout = [-0.25, -0.5]
    hot = rl_record(sampling_params={"temperature": 0.7}, rollout_logprobs=rollout)
    one = rl_record(sampling_params={"temperature": 1.0}, rollout_logprobs=rollout)
    model.train()
    recomputed = old_logprobs(
        model, collate([hot, one]), train_config(old_logprobs="recompute", rollout_correction="none")
    )
    assert model.training  # the caller decides the mode; the loop runs this pass in eval mode
    got = old_logprobs(model, collate([hot, one]), train_config(old_logprobs="rollout", rollout_correction="none"))
    close(got.adv[0], recomputed.adv[0].tolist())  # drawn at T = 0.7: the T = 1 recomputation
    close(got.adv[1], rollout)  # drawn at T = 1: the rollout's own
    close(got.pg[0], rollout)  # the PPO term keeps the rollout's old log-probs (its IS weight corrects them)


def _train_once(model0, samples: list[Sample], cfg: TrainConfig) -> tuple[dict, dict]:
    import copy

    from trainer.train import train_on_batch

    model = copy.deepcopy(model0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = train_on_batch(
        model, model, None, opt, samples, [False] * len(samples), cfg, RunningMean(), 0, 1, torch.device("cpu"), None
    )
    return m, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unclipped_config(model_dir, micro_batch_size: int = 4, **kw) -> TrainConfig:
    """Micro-batches of 4, no baseline, no rollout correction and no gradient clipping, so the compared
    updates differ only by what the test feeds them (paths are never opened)."""
    return TrainConfig(
        model_path=str(model_dir),
        out_dir="unused",
        micro_batch_size=micro_batch_size,
        baseline="none",
        rollout_correction="none",
        max_grad_norm=0.0,
        **kw,
    )


@pytest.mark.slow
def test_rows_without_a_learning_term_do_not_dilute_the_step(tiny_model_dir):
    """Baseline none: a promoted (reward 0) 4-token sample beside two 3-token ones changes nothing at all
    (counted, it would add 4 tokens to the 6-token denominator: gradient x0.6). It gets its own micro-batch, so
    both runs compute the other two identically and the weights must be bit-identical, not close (a shared
    micro-batch would pad them differently, and Adam turns that rounding into differences of up to lr)."""
    from transformers import AutoModelForCausalLM

    model0 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    a = rl_record(sample_id="a", response_ids=[7, 8, 9], rollout_logprobs=[-1.0] * 3, loss_mask=[1] * 3, reward=1.0)
    c = rl_record(sample_id="c", response_ids=[10, 11, 12], rollout_logprobs=[-1.0] * 3, loss_mask=[1] * 3, reward=-1.0)
    promoted = rl_record(
        sample_id="p", response_ids=[13, 14, 15, 16], rollout_logprobs=[-1.0] * 4, loss_mask=[1] * 4, reward=0.0
    )
    cfg = _unclipped_config(tiny_model_dir, micro_batch_size=2)
    m3, w3 = _train_once(model0, [a, c, promoted], cfg)
    m2, w2 = _train_once(model0, [a, c], cfg)
    assert m3["n_learning_samples"] == 2 and m3["n_tokens"] == 6 and m3["grad_norm"] == m2["grad_norm"]
    for k in w2:
        assert torch.equal(w3[k], w2[k]), k


@pytest.mark.slow
def test_topk_term_is_divided_by_the_tokens_with_topk_rows(tiny_model_dir):
    """Token mean: a 3-token sample with teacher top-K rows (reward 0, baseline none: no RL term) next to a 3-token
    RL sample without them. The top-K term is sum(KL) / 3 (its own rows), not sum(KL) / 6 (every valid token);
    the logged ``topk_kl`` is per valid token, so loss - pg_loss = c * topk_kl * 6 / 3."""
    from transformers import AutoModelForCausalLM

    model0 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    rows = {"ids": [[1, 2]] * 3, "logprobs": [[-0.5, -1.0]] * 3}
    a = rl_record(
        sample_id="a",
        response_ids=[7, 8, 9],
        rollout_logprobs=[-1.0] * 3,
        loss_mask=[1] * 3,
        reward=0.0,
        teacher_topk=rows,
    )
    b = rl_record(sample_id="b", response_ids=[10, 11, 12], rollout_logprobs=[-1.0] * 3, loss_mask=[1] * 3, reward=1.0)
    c = 0.5
    cfg = _unclipped_config(
        tiny_model_dir,
        topk_coef=c,
        ppo_epochs=1,
        minibatches=1,
    )
    m, _ = _train_once(model0, [a, b], cfg)
    assert m["n_learning_samples"] == 2 and m["n_tokens"] == 6 and m["topk_kl"] > 0
    assert m["loss"] - m["pg_loss"] == pytest.approx(c * m["topk_kl"] * 6 / 3, rel=1e-5)


@pytest.mark.slow
def test_no_grad_passes_run_in_eval_mode(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model0 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).train()
    seen: list[tuple[bool, bool]] = []  # (grad enabled, training) per forward
    model0.register_forward_pre_hook(lambda mod, args: seen.append((torch.is_grad_enabled(), mod.training)))
    cfg = TrainConfig(model_path=str(tiny_model_dir), out_dir="unused", micro_batch_size=4, rollout_correction="none")
    import copy

    from trainer.train import train_on_batch

    model = copy.deepcopy(model0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_on_batch(
        model,
        model,
        None,
        opt,
        [rl_record(sample_id="a"), rl_record(sample_id="b", reward=-1.0)],
        [False, False],
        cfg,
        RunningMean(),
        0,
        1,
        torch.device("cpu"),
        None,
    )
    assert seen and all(not training for grad, training in seen if not grad)  # old log-probs: eval
    assert any(grad and training for grad, training in seen) and model.training  # the update: train, and left so
