"""PPO-clip policy loss, its aggregation, KL/entropy terms and the top-K distillation loss (pure tensors).

Shapes: B samples, T response positions, V vocabulary, K teacher top-K. ``mask`` is the (B, T) loss mask.

Contract:
- ``ppo_clip_loss``: ratio = exp(lp - old_lp); per-token loss max(-A ratio, -A clip(ratio, 1-eps_low, 1+eps_high)),
  eps 0.2 / 0.28 by default (DAPO clip-higher).
- ``aggregate``: the step's denominator counts VALID tokens (token_mean) or samples with at least one
  valid token (seq_mean) over the whole optimizer batch, passed in by the caller so that micro-batching
  and DDP sharding do not change the loss. Samples with an all-zero mask add nothing to numerator or
  denominator: excluded turns never dilute the step.
- ``low_var_kl``: k3 estimator exp(ref - lp) - (ref - lp) - 1, clamped to [-10, 10] as slime does.
- ``topk_reverse_kl``: reverse KL D(student || teacher) over the teacher's top-K tokens plus one tail bin
  log(1 - sum_k p_k); rows marked invalid (padding, missing teacher rows) contribute exactly 0. The student
  log-softmax is computed once and gathered (no K copies of the logits).
"""

from __future__ import annotations

import torch

from trainer.choices import AGGREGATIONS


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) targets -> (B, T) log p(target)."""
    # logsumexp + gather instead of a full log_softmax copy: one (B, T, V) buffer less.
    return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of the softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def ppo_clip_loss(
    logprobs: torch.Tensor,  # (B, T) current policy, with grad
    old_logprobs: torch.Tensor,  # (B, T) behaviour policy, no grad
    advantages: torch.Tensor,  # (B, T) no grad
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss (B, T), clipped indicator (B, T) and ratio (B, T)."""
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # the clamp only guards exp() overflow on garbage inputs
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float(), ratio


def aggregate(
    per_token: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    mode: str,
    *,
    num_tokens: float,  # valid tokens in the whole optimizer batch (all ranks, all micro-batches)
    num_seqs: float,  # samples with >= 1 valid token in the whole optimizer batch
) -> torch.Tensor:
    """This micro-batch's share of the batch mean; summing the shares gives the batch loss."""
    m = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * m).sum() / max(num_tokens, 1.0)
    if mode == "seq_mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # all-masked rows are 0 / 1 = 0
        return per_seq.sum() / max(num_seqs, 1.0)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 KL estimate of KL(pi || ref) per token (B, T), non-negative, low variance."""
    log_ratio = (ref_logprobs.detach() - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def topk_reverse_kl(
    student_logits: torch.Tensor,  # (B, T, V)
    teacher_ids: torch.Tensor,  # (B, T, K) long
    teacher_logprobs: torch.Tensor,  # (B, T, K)
    valid: torch.Tensor,  # (B, T) 1 where the teacher row is real and the token is trained
) -> torch.Tensor:  # (B, T), 0 on invalid rows
    """Reverse KL sum_bins p_s (log p_s - log p_t) over K teacher tokens + a tail bin."""
    v = valid.bool()
    ids = torch.where(v[..., None], teacher_ids, torch.zeros_like(teacher_ids))
    t_lp = torch.where(v[..., None], teacher_logprobs.float(), torch.full_like(teacher_logprobs.float(), -1e4))
    s_all = torch.log_softmax(student_logits.float(), dim=-1)
    s_lp = s_all.gather(-1, ids)  # (B, T, K)

    def with_tail(lp: torch.Tensor) -> torch.Tensor:  # (B, T, K) -> (B, T, K+1)
        # log(1 - exp(lse)) with lse <= -1e-7 so the tail bin stays finite when top-K holds all the mass.
        lse = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([lp, torch.log(-torch.expm1(lse))], dim=-1)

    s_bins, t_bins = with_tail(s_lp), with_tail(t_lp)
    kl = (s_bins.exp() * (s_bins - t_bins)).sum(-1)
    return torch.where(v, kl, torch.zeros_like(kl))
