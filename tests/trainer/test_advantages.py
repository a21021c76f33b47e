"""Advantage math (trainer/advantages.py) against hand-derived values.

Contract under test: rl (r - b, optional /std, only samples with has_reward), opd (teacher - old), combine
(each term only where present), AReaL shaping (additive | gvpo | process_weighted),
PRM-gated OPD and multiplicative OPD; padding always carries 0.
"""

from __future__ import annotations

import pytest
import torch

from trainer.advantages import (
    RunningMean,
    broadcast_to_tokens,
    combine_advantages,
    multiplicative_opd,
    opd_advantages,
    prm_gated_opd,
    rl_sample_advantages,
    shape_advantages,
    turn_steps,
)

pytestmark = pytest.mark.unit
T = torch.tensor


def close(a: torch.Tensor, b: list | torch.Tensor) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=1e-5, rtol=1e-5)


def test_rl_plain_broadcasts_reward_and_masks_padding():
    adv = rl_sample_advantages(T([1.0, -1.0, 0.0]), T([True, True, True]))
    close(adv, [1.0, -1.0, 0.0])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(broadcast_to_tokens(adv, mask), [[1, 1, 0], [-1, 0, 0], [0, 0, 0]])


def test_rl_batch_mean_ignores_samples_without_reward():
    # rewards 1, -1, 1 present -> mean 1/3; the missing one (value 5 is garbage) stays 0.
    adv = rl_sample_advantages(T([1.0, -1.0, 1.0, 5.0]), T([True, True, True, False]), baseline="batch_mean")
    close(adv, [2 / 3, -4 / 3, 2 / 3, 0.0])


def test_rl_batch_mean_normalized():
    # r = 1, -1 -> centred 1, -1 -> population std 1 -> unchanged (up to eps).
    adv = rl_sample_advantages(T([1.0, -1.0]), T([True, True]), baseline="batch_mean", normalize=True, eps=0.0)
    close(adv, [1.0, -1.0])
    # r = 3, 1 -> centred 1, -1; std 1.  r = 4, 0 -> centred 2, -2; std 2 -> 1, -1.
    adv = rl_sample_advantages(T([4.0, 0.0]), T([True, True]), baseline="batch_mean", normalize=True, eps=0.0)
    close(adv, [1.0, -1.0])


def test_rl_running_mean_uses_earlier_samples():
    rm = RunningMean(momentum=0.5)
    a1 = rl_sample_advantages(T([1.0, 1.0]), T([True, True]), baseline="running_mean", running=rm)
    close(a1, [0.0, 0.0])  # first batch: no history, its own mean (1.0); then per sample: 1, 0.5*1+0.5*1 = 1
    assert rm.value == pytest.approx(1.0) and rm.count == 2
    a2 = rl_sample_advantages(T([-1.0, 0.0]), T([True, True]), baseline="running_mean", running=rm)
    close(a2, [-2.0, -1.0])  # baseline 1.0 from the earlier samples
    assert rm.value == pytest.approx(0.5 * (0.5 * 1.0 + 0.5 * -1.0) + 0.5 * 0.0)


def test_rl_no_rewards_at_all_is_zero_not_nan():
    adv = rl_sample_advantages(T([0.0, 0.0]), T([False, False]), baseline="batch_mean", normalize=True)
    close(adv, [0.0, 0.0])


def test_rl_rejects_unknown_baseline():
    with pytest.raises(ValueError):
        rl_sample_advantages(T([1.0]), T([True]), baseline="median")


def test_opd_is_teacher_minus_old_only_where_teacher_and_mask():
    teacher = T([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    old = T([[-1.5, -1.0, -3.0], [-1.0, -1.0, -1.0]])
    mask = T([[1, 1, 0], [1, 1, 1]])
    close(opd_advantages(teacher, old, mask, T([True, False])), [[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]])


def test_combine_applies_each_term_only_where_present():
    teacher = T([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    old = T([[-2.0, -3.0], [-2.0, -3.0], [-2.0, -3.0]])  # teacher - old = 1, 2
    mask = T([[1, 1], [1, 0], [1, 1]])
    rl = T([1.0, -1.0, 7.0])
    has_t = T([True, True, False])
    has_r = T([True, False, True])
    out = combine_advantages(teacher, old, rl, mask, has_t, has_r, w_opd=T([0.5, 0.5, 0.5]), w_rl=T([2.0, 2.0, 2.0]))
    # row0: 0.5*[1,2] + 2*1 = [2.5, 3]; row1: opd only, masked 2nd: [0.5, 0]; row2: rl only: [14, 14]
    close(out, [[2.5, 3.0], [0.5, 0.0], [14.0, 14.0]])


@pytest.mark.parametrize(
    "a, p, expected",
    [
        ([1.0, -1.0, 0.0], [0.5, 0.5, -0.25], [1.5, -0.5, -0.25]),
    ],
)
def test_shape_additive(a, p, expected):
    close(shape_advantages(T(a), T(p), "additive"), expected)


def test_shape_additive_respects_mask():
    out = shape_advantages(T([1.0, 1.0]), T([0.5, 0.5]), "additive", mask=T([1, 0]))
    close(out, [1.5, 1.0])


def test_shape_gvpo_exact_cases():
    a = T([-1.0, 0.0, 1e-7, 2.0, -1.0, 3.0, -2.0])
    p = T([-0.1, -0.1, -0.1, -0.1, 0.0, 0.5, -1.0])
    mask = T([1, 1, 1, 1, 1, 1, 0])
    out = shape_advantages(a, p, "gvpo", negative_scale=0.2, zero_penalty=0.4, eps=1e-6, mask=mask)
    # failed&A<-eps -> 1.2A; |A|<=eps -> -0.4 (twice); A>eps -> 0; p=0 not failed; p>0 unchanged; mask 0 unchanged
    close(out, [-1.2, -0.4, -0.4, 0.0, -1.0, 3.0, -2.0])


def test_shape_process_weighted_exact_cases():
    a = T([2.0, 0.0, -1.0, -1.0, -3.0])
    p = T([0.5, 1.0, 0.25, 0.0, 0.9])
    mask = T([1, 1, 1, 1, 0])
    out = shape_advantages(a, p, "process_weighted", mask=mask)
    # A>=0 -> A p; A<0 & p>0 -> p; A<0 & p=0 -> A; inactive keeps A
    close(out, [1.0, 0.0, 0.25, -1.0, -3.0])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_shape_process_weighted_rejects_out_of_range(bad):
    with pytest.raises(ValueError):
        shape_advantages(T([1.0, 1.0]), T([0.5, bad]), "process_weighted")


def test_shape_process_weighted_ignores_out_of_range_on_inactive_tokens():
    out = shape_advantages(T([1.0, 1.0]), T([0.5, 7.0]), "process_weighted", mask=T([1, 0]))
    close(out, [0.5, 1.0])


def test_shape_rejects_bad_params_and_modes():
    with pytest.raises(ValueError):
        shape_advantages(T([1.0]), T([1.0]), "gvpo", negative_scale=-1.0)
    with pytest.raises(ValueError):
        shape_advantages(T([1.0]), T([1.0]), "gvpo", zero_penalty=float("inf"))
    with pytest.raises(ValueError):
        shape_advantages(T([1.0]), T([1.0]), "multiply")
    with pytest.raises(ValueError):
        shape_advantages(T([1.0, 2.0]), T([1.0]), "additive")


def test_prm_gated_opd_cuts_after_first_wrong_step():
    teacher = T([[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0, 0.0, 0.0]])
    old = T([[-2.0, -1.5, -3.0, -1.0, -2.0, 0.0], [-2.0, -2.0, -2.0, -2.0, 0.0, 0.0]])  # diff row0: 1, .5, 2, 0, 1, -1
    # row0: steps 0,0,1,1,2,2 with scores +1, -1, +1 -> step0 OPD, step1 -1, step2 0 (after the cut)
    # row1: steps 0,0,1,1 (then padding) with scores +1, +1 -> all OPD, padding 0
    step_ids = T([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, -1, -1]])
    scores = T([[1.0, -1.0, 1.0], [1.0, 1.0, 0.0]])
    out = prm_gated_opd(teacher, old, step_ids, scores)
    close(out, [[1.0, 0.5, -1.0, -1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])


def test_prm_gated_opd_zero_and_nan_scores_count_as_wrong():
    teacher, old = torch.zeros(2, 2), torch.full((2, 2), -1.0)
    step_ids, scores = turn_steps(T([[1, 1], [1, 0]]), T([0.0, float("nan")]))
    close(prm_gated_opd(teacher, old, step_ids, scores, wrong_value=-0.5), [[-0.5, -0.5], [-0.5, 0.0]])


def test_multiplicative_opd():
    teacher = T([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    old = T([[-1.5, -2.0, -0.5], [-3.0, -1.0, -1.0]])  # diff 0.5, 1, -0.5 / 2, 0, 0
    step_ids = T([[0, 1, 1], [0, 0, -1]])
    scores = T([[1.0, -1.0], [0.5, 0.0]])
    # step 1 of row 0 is wrong (-1): both its tokens are negative, -|d| (the literal product would give +0.5)
    close(multiplicative_opd(teacher, old, step_ids, scores), [[0.5, -1.0, -0.5], [1.0, 0.0, 0.0]])


def test_turn_steps_layout():
    step_ids, scores = turn_steps(T([[1, 1, 0]]), T([1.0]))
    assert step_ids.tolist() == [[0, 0, -1]] and scores.tolist() == [[1.0]]
