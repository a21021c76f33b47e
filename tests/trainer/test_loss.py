"""PPO-clip loss, aggregation, k3 KL and top-K reverse KL (trainer/loss.py) against hand-derived values.

Contract under test: clip at 1-0.2 / 1+0.28 by default; token_mean and seq_mean divide by VALID tokens /
sequences of the whole batch, so all-masked samples never dilute; the top-K loss equals an explicit
K+1-bin reverse KL and is exactly 0 (with zero gradient) on padding rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.numerics import reorder_atol
from trainer.loss import aggregate, entropy_from_logits, low_var_kl, ppo_clip_loss, token_logprobs, topk_reverse_kl

pytestmark = pytest.mark.unit
T = torch.tensor


def test_ppo_clip_hand_values():
    old = torch.zeros(1, 4)
    # ratios 1.5 (A>0: clipped at 1.28), 0.5 (A<0: clipped at 0.8 -> larger loss), 1.1 (inside), 0.5 (A>0: unclipped min)
    lp = torch.log(T([[1.5, 0.5, 1.1, 0.5]]))
    adv = T([[1.0, -1.0, 2.0, 1.0]])
    loss, clipped, ratio = ppo_clip_loss(lp, old, adv)
    torch.testing.assert_close(loss, T([[-1.28, 0.8, -2.2, -0.5]]))
    assert clipped.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    torch.testing.assert_close(ratio, T([[1.5, 0.5, 1.1, 0.5]]))


def test_ppo_clip_gradient_is_zero_when_clipped():
    lp = torch.log(T([[1.5, 1.1]])).requires_grad_()
    loss, _, _ = ppo_clip_loss(lp, torch.zeros(1, 2), T([[1.0, 1.0]]))
    loss.sum().backward()
    # d(-A r)/d lp = -A r: 0 for the clipped token, -1.1 for the free one
    torch.testing.assert_close(lp.grad, T([[0.0, -1.1]]))


def test_aggregate_token_mean_counts_only_valid_tokens():
    per_tok = T([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # third sample excluded entirely
    out = aggregate(per_tok, mask, "token_mean", num_tokens=3, num_seqs=2)
    assert out.item() == pytest.approx((1 + 2 + 3) / 3)


def test_aggregate_seq_mean_ignores_excluded_samples():
    per_tok = T([[1.0, 3.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = aggregate(per_tok, mask, "seq_mean", num_tokens=3, num_seqs=2)
    assert out.item() == pytest.approx((2.0 + 4.0) / 2)


def test_aggregate_microbatch_shares_sum_to_batch_mean():
    torch.manual_seed(0)
    per_tok, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.4).long()
    mask[2] = 0
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    for mode in ("token_mean", "seq_mean"):
        whole = aggregate(per_tok, mask, mode, num_tokens=n_tok, num_seqs=n_seq)
        parts = sum(
            aggregate(per_tok[i : i + 2], mask[i : i + 2], mode, num_tokens=n_tok, num_seqs=n_seq) for i in (0, 2, 4)
        )
        # Another summation order over the same float32 terms: tolerance from their count and magnitude.
        assert parts.item() == pytest.approx(
            whole.item(), abs=reorder_atol(per_tok.numel(), float(per_tok.abs().max()))
        )
    with pytest.raises(ValueError):
        aggregate(per_tok, mask, "sum", num_tokens=1, num_seqs=1)


def test_low_var_kl_k3():
    lp, ref = T([0.0, math.log(0.5)]), T([0.0, 0.0])
    # k3 = e^(ref-lp) - (ref-lp) - 1: 0 and 2 - ln2 - 1
    torch.testing.assert_close(low_var_kl(lp, ref), T([0.0, 1.0 - math.log(2.0)]))


def test_token_logprobs_and_entropy():
    logits = torch.log(T([[[0.5, 0.25, 0.25]]]))
    torch.testing.assert_close(token_logprobs(logits, T([[1]])), T([[math.log(0.25)]]))
    h = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    torch.testing.assert_close(entropy_from_logits(logits), T([[h]]))


def test_topk_reverse_kl_matches_explicit_bins():
    # V=4; student p = [0.4, 0.3, 0.2, 0.1]; teacher top-2 = token 2 (0.5), token 0 (0.3), tail 0.2
    s_logits = torch.log(T([[[0.4, 0.3, 0.2, 0.1]]]))
    ids = T([[[2, 0]]])
    t_lp = torch.log(T([[[0.5, 0.3]]]))
    out = topk_reverse_kl(s_logits, ids, t_lp, T([[1]]))
    s_bins, t_bins = [0.2, 0.4, 0.4], [0.5, 0.3, 0.2]
    expected = sum(s * math.log(s / t) for s, t in zip(s_bins, t_bins, strict=True))
    assert out.item() == pytest.approx(expected, abs=1e-5)


def test_topk_reverse_kl_zero_when_equal_and_masked_rows_inert():
    p = T([0.5, 0.3, 0.15, 0.05])
    s_logits = torch.log(p).expand(1, 2, 4).clone().requires_grad_()
    ids = T([[[0, 1, 2], [0, 1, 2]]])
    t_lp = torch.log(p[:3]).expand(1, 2, 3).clone()
    t_lp[0, 1] = 0.0  # a placeholder row (padding written as log-prob 0): must not matter when masked
    out = topk_reverse_kl(s_logits, ids, t_lp, T([[1, 0]]))
    assert out[0, 0].item() == pytest.approx(0.0, abs=1e-6)
    assert out[0, 1].item() == 0.0
    out.sum().backward()
    assert torch.all(s_logits.grad[0, 1] == 0)
    assert torch.isfinite(s_logits.grad).all()


def test_topk_tail_finite_when_topk_holds_all_mass():
    s_logits = torch.log(T([[[0.5, 0.5]]]))
    out = topk_reverse_kl(s_logits, T([[[0, 1]]]), torch.log(T([[[0.5, 0.5]]])), T([[1]]))
    assert torch.isfinite(out).all() and abs(out.item()) < 1e-5
