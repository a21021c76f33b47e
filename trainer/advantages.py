"""Token advantages for every sample mode, as pure vectorized torch (no model, no I/O).

Shapes: B samples, T response positions (right-padded), S steps. ``mask`` is the (B, T) loss mask
(1 on trained response tokens, 0 on padding and on excluded samples). Every function returns zeros
where ``mask`` is 0, so padding and excluded samples never carry an advantage.

Contracts (docs/CONTRACTS.md "Sample JSON"):

- rl:        A_t = r - b with the baselines of trainer.baselines (running by default; optional / std,
             never by eps). Only samples with ``has_reward`` count (in the baseline too); the others get
             A = 0, never a silent reward of 0.
- opd:       A_t = teacher_lp_t - old_lp_t where ``has_teacher``; old is the rollout log-prob or the
             trainer's recomputation (a trainer setting, chosen by the caller).
- combine:   A_t = w_opd * (teacher_lp_t - old_lp_t) + w_rl * A^rl_t, each term only where the sample has
             it (``has_teacher`` / ``has_reward``); the weights are per sample (B,), as the sample carries them.
- shape_advantages: AReaL's process-reward shaping (additive | gvpo | process_weighted), exact formulas
             of ``areal/trainer/ppo/actor.py``, applied after normalisation. Our ``token_rewards`` are already
             aligned to response ids, and our log-probs are per response id, so AReaL's roll by -1 (from
             prompt+response positions to next-token positions) is already done by the layout.
- prm_gated_opd: OPD inside steps the PRM judged correct (score > 0), a uniform
             ``wrong_value`` on the first step judged wrong (score <= 0 or NaN), 0 after it.
- multiplicative (PRM sets the weight, OPD the direction, every token of a wrong step is
             negative): with d_t = teacher_lp_t - old_lp_t and s = PRM_step(t), A_t = s d_t when s > 0,
             0 when s = 0 (or no verdict, NaN), -|s| |d_t| when s < 0.
- multiplicative_literal: the literal product s d_t, an explicit opt-in. Its sign problem: in a wrong step
             (s < 0) a token the teacher rejects (d_t < 0) gets A_t = s d_t > 0 and is REINFORCED, most
             strongly where the teacher disagrees most.

A Hindsight sample is one turn with one PRM verdict, so the loop uses one step per sample
(``turn_steps``); the step functions accept any step segmentation for multi-step scorers.
"""

from __future__ import annotations

import math

import torch

from trainer.baselines import BASELINES, RunningMean, rl_sample_advantages
from trainer.choices import SHAPING_MODES

__all__ = [
    "BASELINES",
    "SHAPING_MODES",
    "RunningMean",
    "rl_sample_advantages",
    "broadcast_to_tokens",
    "opd_advantages",
    "combine_advantages",
    "shape_advantages",
    "turn_steps",
    "prm_gated_opd",
    "multiplicative_opd",
    "multiplicative_opd_literal",
]


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
    """AReaL advantage shaping, exact:

    additive:          A' = A + p   (on active tokens; inactive tokens keep A)
    gvpo:              failed = p < 0 and m = 1; on failed tokens A' = (1 + negative_scale) A if A < -eps,
                       -zero_penalty if |A| <= eps, 0 if A > eps; other tokens keep A
    process_weighted:  p must be in [0, 1] on active tokens (ValueError otherwise); on active tokens
                       A' = A p if A >= 0, else p if p > 0, else A; inactive tokens keep A
    """
    if advantages.shape != process_rewards.shape:
        raise ValueError(
            f"shape mismatch: advantages {tuple(advantages.shape)} vs process_rewards {tuple(process_rewards.shape)}"
        )
    _check_nonneg_finite(negative_scale=negative_scale, zero_penalty=zero_penalty, eps=eps)
    a = advantages
    p = process_rewards.to(a.dtype)
    active = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.bool()
    if mode == "additive":
        return torch.where(active, a + p, a)
    if mode == "gvpo":
        failed = (p < 0) & active
        shaped = torch.where(
            a < -eps,
            (1.0 + negative_scale) * a,
            torch.where(a.abs() <= eps, torch.full_like(a, -zero_penalty), torch.zeros_like(a)),
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
    step_ids = torch.where(
        mask.bool(), torch.zeros_like(mask, dtype=torch.long), torch.full_like(mask, -1, dtype=torch.long)
    )
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
    """OPD where the PRM says the step is right; uniform penalty on the first wrong step; 0 after."""
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
    """s d_t in a right step (s > 0), 0 in a neutral one, -|s| |d_t| in a wrong one (never positive)."""
    score = _step_score_per_token(step_ids, step_scores)
    d = teacher_lp.float() - old_lp.float()
    # NaN (no verdict) gives no weight: nan_to_num before the comparisons keeps NaN out of the result.
    s = torch.nan_to_num(score, nan=0.0)
    out = torch.where(s > 0, s * d, torch.where(s < 0, -s.abs() * d.abs(), torch.zeros_like(d)))
    return torch.where(step_ids >= 0, out, torch.zeros_like(out))


def multiplicative_opd_literal(
    teacher_lp: torch.Tensor,  # (B, T)
    old_lp: torch.Tensor,  # (B, T)
    step_ids: torch.Tensor,  # (B, T) long, -1 on padding
    step_scores: torch.Tensor,  # (B, S)
) -> torch.Tensor:  # (B, T)
    """The literal product s * d_t (opt-in ``multiplicative_literal``): REINFORCES teacher-rejected tokens of
    wrong steps (s < 0, d_t < 0 -> A_t > 0); see the module docstring. A missing verdict (NaN) gives 0."""
    score = torch.nan_to_num(_step_score_per_token(step_ids, step_scores), nan=0.0)
    out = score * (teacher_lp.float() - old_lp.float())
    return torch.where(step_ids >= 0, out, torch.zeros_like(out))
