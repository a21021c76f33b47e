"""Token advantages for every sample mode, as pure vectorized torch (no model, no I/O).

Shapes: B samples, T response positions (right-padded), S steps. ``mask`` is the (B, T) loss mask
(1 on trained response tokens, 0 on padding and on excluded samples). Every function returns zeros
where ``mask`` is 0, so padding and excluded samples never carry an advantage.

Contracts (docs/CONTRACTS.md "Sample JSON"; ../shared/reference/openclaw-rl-notes.md §6.3, §7.6, §8.2;
../shared/reference/peers.md §1.4; ../shared/seeds/003_697b12601d0308a7.txt §5.2, §5.3):

- rl:        A_t = r - b, optionally divided by the std of (r - b) over the batch; b is 0, the batch
             mean, or a running mean of earlier batches. Only samples with ``has_reward`` count
             (in the baseline too); the others get A = 0, never a silent reward of 0.
- opd:       A_t = teacher_lp_t - old_lp_t where ``has_teacher``; old is the rollout log-prob or the
             trainer's recomputation (a trainer setting, chosen by the caller).
- combine:   A_t = w_opd * (teacher_lp_t - old_lp_t) + w_rl * A^rl_t, each term only where the sample has
             it (``has_teacher`` / ``has_reward``); the weights are per sample (B,), as the sample carries them.
- shape_advantages: AReaL's process-reward shaping (additive | gvpo | process_weighted), exact formulas
             of ``areal/trainer/ppo/actor.py``, applied after normalisation. Our ``token_rewards`` are already
             aligned to response ids, and our log-probs are per response id, so AReaL's roll by -1 (from
             prompt+response positions to next-token positions) is already done by the layout.
- prm_gated_opd (seed §5.2): OPD inside steps the PRM judged correct (score > 0), a uniform
             ``wrong_value`` on the first step judged wrong (score <= 0 or NaN), 0 after it.
- multiplicative (seed §5.3): A_t = PRM_step(t) * (teacher_lp_t - old_lp_t).

A Hindsight sample is one turn with one PRM verdict, so the loop uses one step per sample
(``turn_steps``); the step functions accept any step segmentation for multi-step scorers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SHAPING_MODES = ("additive", "gvpo", "process_weighted")
BASELINES = ("none", "batch_mean", "running_mean")


@dataclass
class RunningMean:
    """Exponential moving average of rewards across batches; its state lives in the checkpoint."""

    momentum: float = 0.9
    value: float = 0.0
    count: int = 0

    def update(self, batch_mean: float) -> None:
        # The first batch initialises the average, so no fake prior of 0 biases the early baseline.
        self.value = batch_mean if self.count == 0 else self.momentum * self.value + (1 - self.momentum) * batch_mean
        self.count += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"momentum": self.momentum, "value": self.value, "count": self.count}


def rl_sample_advantages(
    rewards: torch.Tensor,  # (B,) float; ignored where has_reward is False
    has_reward: torch.Tensor,  # (B,) bool
    *,
    baseline: str = "none",
    normalize: bool = False,
    running: RunningMean | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:  # (B,) float, 0 where has_reward is False
    """Per-sample RL advantage r - b (optionally / std). Computed on the WHOLE batch (all DDP ranks agree)."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    has = has_reward.bool()
    r = torch.where(has, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    n = int(has.sum())
    if n == 0:
        return torch.zeros_like(r)
    batch_mean = float(r.sum() / n)
    if baseline == "batch_mean":
        b = batch_mean
    elif baseline == "running_mean":
        if running is None:
            raise ValueError("baseline 'running_mean' needs a RunningMean")
        # The baseline uses earlier batches only; this batch then updates it.
        b = running.value if running.count > 0 else batch_mean
        running.update(batch_mean)
    else:
        b = 0.0
    adv = torch.where(has, r - b, torch.zeros_like(r))
    if normalize:
        # Population std over the samples that have a reward (a single sample has std 0 -> eps).
        std = float((adv[has].pow(2).sum() / n - (adv[has].sum() / n) ** 2).clamp(min=0).sqrt())
        adv = adv / (std + eps)
    return adv


def broadcast_to_tokens(sample_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T): the same advantage on every trained token of the sample."""
    return sample_adv[:, None].to(torch.float32) * mask.to(torch.float32)


def opd_advantages(
    teacher_lp: torch.Tensor,  # (B, T)
    old_lp: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    has_teacher: torch.Tensor,  # (B,) bool
) -> torch.Tensor:  # (B, T)
    """A_t = teacher_lp - old_lp on trained tokens of samples that have teacher log-probs."""
    m = mask.to(torch.float32) * has_teacher.to(torch.float32)[:, None]
    # where() instead of a product: a missing teacher row may hold NaN/garbage and must not leak.
    return torch.where(m > 0, teacher_lp.float() - old_lp.float(), torch.zeros_like(m))


def combine_advantages(
    teacher_lp: torch.Tensor,  # (B, T)
    old_lp: torch.Tensor,  # (B, T)
    rl_sample_adv: torch.Tensor,  # (B,) from rl_sample_advantages
    mask: torch.Tensor,  # (B, T)
    has_teacher: torch.Tensor,  # (B,) bool
    has_reward: torch.Tensor,  # (B,) bool
    w_opd: torch.Tensor,  # (B,)
    w_rl: torch.Tensor,  # (B,)
) -> torch.Tensor:  # (B, T)
    """w_opd * (teacher - old) + w_rl * A_rl, each term only where the sample has it."""
    opd = opd_advantages(teacher_lp, old_lp, mask, has_teacher)
    rl = broadcast_to_tokens(torch.where(has_reward.bool(), rl_sample_adv, torch.zeros_like(rl_sample_adv)), mask)
    return w_opd.float()[:, None] * opd + w_rl.float()[:, None] * rl


def _check_nonneg_finite(**values: float) -> None:
    for name, v in values.items():
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")


def shape_advantages(
    advantages: torch.Tensor,  # (..., T) normalised outcome advantage A_t
    process_rewards: torch.Tensor,  # (..., T) process reward p_t, same shape
    mode: str,
    *,
    negative_scale: float = 0.2,
    zero_penalty: float = 0.4,
    eps: float = 1e-6,
    mask: torch.Tensor | None = None,  # (..., T) loss mask m_t; None = every token active
) -> torch.Tensor:
    """AReaL advantage shaping (peers.md §1.4), exact:

    additive:          A' = A + p   (on active tokens; inactive tokens keep A)
    gvpo:              failed = p < 0 and m = 1; on failed tokens A' = (1 + negative_scale) A if A < -eps,
                       -zero_penalty if |A| <= eps, 0 if A > eps; other tokens keep A
    process_weighted:  p must be in [0, 1] on active tokens (ValueError otherwise); on active tokens
                       A' = A p if A >= 0, else p if p > 0, else A; inactive tokens keep A
    """
    if advantages.shape != process_rewards.shape:
        raise ValueError(f"shape mismatch: advantages {tuple(advantages.shape)} vs process_rewards {tuple(process_rewards.shape)}")
    _check_nonneg_finite(negative_scale=negative_scale, zero_penalty=zero_penalty, eps=eps)
    a = advantages
    p = process_rewards.to(a.dtype)
    active = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.bool()
    if mode == "additive":
        return torch.where(active, a + p, a)
    if mode == "gvpo":
        failed = (p < 0) & active
        shaped = torch.where(
            a < -eps, (1.0 + negative_scale) * a, torch.where(a.abs() <= eps, torch.full_like(a, -zero_penalty), torch.zeros_like(a))
        )
        return torch.where(failed, shaped, a)
    if mode == "process_weighted":
        p_active = p[active]
        if p_active.numel() and bool(((p_active < 0) | (p_active > 1) | p_active.isnan()).any()):
            raise ValueError("process_weighted requires process rewards in [0, 1] on active tokens")
        shaped = torch.where(a >= 0, a * p, torch.where(p > 0, p, a))
        return torch.where(active, shaped, a)
    raise ValueError(f"unknown shaping mode {mode!r}; expected one of {SHAPING_MODES}")


def turn_steps(mask: torch.Tensor, reward: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step per sample (a Hindsight sample is one turn with one PRM verdict).

    Returns step_ids (B, T) long (0 on trained tokens, -1 elsewhere) and step_scores (B, 1).
    """
    step_ids = torch.where(mask.bool(), torch.zeros_like(mask, dtype=torch.long), torch.full_like(mask, -1, dtype=torch.long))
    return step_ids, reward.float()[:, None]


def _step_score_per_token(step_ids: torch.Tensor, step_scores: torch.Tensor) -> torch.Tensor:
    # (B, T): the PRM score of the step each token belongs to (padding reads step 0, masked by callers).
    return step_scores.float().gather(1, step_ids.clamp(min=0))


def prm_gated_opd(
    teacher_lp: torch.Tensor,  # (B, T)
    old_lp: torch.Tensor,  # (B, T)
    step_ids: torch.Tensor,  # (B, T) long, step index of each token, -1 on padding / untrained tokens
    step_scores: torch.Tensor,  # (B, S) PRM score per step
    *,
    wrong_value: float = -1.0,
) -> torch.Tensor:  # (B, T)
    """Seed §5.2: OPD where the PRM says the step is right; uniform penalty on the first wrong step; 0 after."""
    B, S = step_scores.shape
    wrong = ~(step_scores.float() > 0)  # (B, S); NaN (no verdict) is not "correct"
    idx = torch.arange(S, device=step_scores.device).expand(B, S)
    first_wrong = torch.where(wrong, idx, torch.full_like(idx, S)).min(dim=1).values  # (B,), S = none wrong
    valid = step_ids >= 0
    before = valid & (step_ids < first_wrong[:, None])
    at = valid & (step_ids == first_wrong[:, None])
    opd = teacher_lp.float() - old_lp.float()
    zero = torch.zeros_like(opd)
    return torch.where(before, opd, torch.where(at, torch.full_like(opd, wrong_value), zero))


def multiplicative_opd(
    teacher_lp: torch.Tensor,  # (B, T)
    old_lp: torch.Tensor,  # (B, T)
    step_ids: torch.Tensor,  # (B, T) long, -1 on padding
    step_scores: torch.Tensor,  # (B, S)
) -> torch.Tensor:  # (B, T)
    """Seed §5.3: A_t = PRM_step(t) * (teacher_lp_t - old_lp_t); PRM sets the weight, OPD the direction."""
    score = _step_score_per_token(step_ids, step_scores)
    out = score * (teacher_lp.float() - old_lp.float())
    return torch.where(step_ids >= 0, out, torch.zeros_like(out))
