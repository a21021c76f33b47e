"""Off-policy correction for proxied traffic: rollout importance weights and the sampling temperature.

Why: a live client samples with its own
``temperature`` / ``top_p`` and from weights that may be one or more versions behind the trainer, so the
behaviour distribution mu that produced a sample is not the policy pi the trainer optimises. SGLang
returns, per sampled token, log softmax(logits / T) of the sampling weights: temperature-scaled, BEFORE
top-k/top-p truncation. Those are the Sample JSON's ``rollout_logprobs``; the policy server also records
the ``sampling_params`` it sent to the engine (CONTRACTS "Sample JSON"; null in older samples).

Contract:
- ``sample_temperature(sample)``: ``sampling_params.temperature``; 1.0 when the dict or the key is missing
  or null, and 1.0 for T < 1e-6 (SGLang decodes T = 0 greedily, with top_k = 1 and its log-probs at T = 1).
- ``temperature_logprobs(logits, targets, T)``: log softmax(logits / T_i)[target] per row i. With
  ``--logprob-temperature sample`` the trainer recomputes old AND new log-probs of the PPO term this way,
  so the importance weight compares like with like (the policy is then trained at each sample's T);
  with ``one`` (the default) both stay at T = 1 and the weight below absorbs the temperature mismatch.
  KL-to-reference, entropy, top-K distillation and the OPD term teacher - old stay at T = 1 in both
  settings (the teacher scores at T = 1, policy_server ``teacher_temperature``).
- ``rollout_is_weights(old_lp, rollout_lp, mask, mode, cap)``: per-token w_t = exp(old_lp_t - rollout_lp_t),
  where ``old_lp`` are the old log-probs of the PPO ratio (the trainer's recomputation; with
  ``--old-logprobs rollout`` they ARE the rollout log-probs for unconstrained samples, so w = 1 there and
  nothing is corrected twice). ``none``: applied weight 1. ``tis``: min(w, cap) (truncated IS, slime
  ``--use-tis`` / verl ``token_truncate``). ``mis``: w where w <= cap, and tokens with w > cap are rejected
  (masked IS, verl ``token_mask``): weight 0, and the loop removes them from the loss mask, so they leave
  numerator AND denominator
  (slime #657: a rejected token left in the denominator shrinks the step). The applied weight
  is detached and multiplies only the PPO policy-gradient term. Only valid (mask 1) tokens are ever
  weighted or counted; padding and excluded samples get weight 1 and mask 0.
- Constrained samples (forced tool calls, ``constrained: true``) take the same correction: their rollout
  log-probs are log mu(a) of the grammar-masked behaviour distribution, so w = pi(a) / mu(a) is the right
  ratio for it (usually < 1: the mask raised mu above pi). It corrects the tokens that were sampled; the
  masked-out part of pi's support is never sampled and stays untrained.
- Known bias (documented, not corrected): with top-p / top-k the behaviour probability of a kept token is
  p_T / Z_t (Z_t = kept mass <= 1) but the engine reports p_T, so w is overestimated by up to 1 / Z_t; the
  cap bounds it.
- The statistics are SUMS over valid tokens (plus a max) so the loop can all-reduce them exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.records import Sample
from trainer.choices import ROLLOUT_CORRECTIONS
from trainer.loss import token_logprobs

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: below it a request is decoded greedily at T = 1
IS_STAT_KEYS = ("is_tokens", "is_sum", "is_applied_sum", "is_over_cap")


def check_sampling_params(s: Sample) -> str | None:
    """None when ``sampling_params`` is absent or null, or its temperature is null or a finite number >= 0."""
    sp = s.sampling_params
    if sp is None:
        return None
    t = sp.get("temperature")
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return f"sampling_params.temperature must be a finite number >= 0, got {t!r}"
    return None


def sample_temperature(s: Sample) -> float:
    """The temperature the engine sampled (and scaled its log-probs) with; see the module contract."""
    sp = s.sampling_params
    t = sp.get("temperature") if sp is not None else None
    if t is None or isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < GREEDY_EPS:
        return 1.0
    return float(t)


def temperature_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) targets, (B,) temperatures -> (B, T) log softmax(logits / T_i)[target]."""
    if bool((temperature == 1.0).all()):
        return token_logprobs(logits, targets)  # no (B, T, V) copy when every sample is at T = 1
    return token_logprobs(logits / temperature.to(logits)[:, None, None], targets)


@dataclass
class ISWeights:
    applied: torch.Tensor  # (B, T) weight multiplied into the PPO term (1 off the mask; 0 on mis-rejected tokens)
    keep: torch.Tensor  # (B, T) 1 where the token stays in the loss (mis rejects w > cap)
    raw: torch.Tensor  # (B, T) untruncated w (1 off the mask)
    stats: dict[str, float]  # sums over valid tokens: is_tokens, is_sum (raw), is_applied_sum, is_over_cap; is_max


def rollout_is_weights(
    old_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> ISWeights:
    """Per-token rollout importance weights of one micro-batch (see the module contract)."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    valid = mask > 0
    # The clamp only guards exp() overflow (a garbage rollout log-prob); any such weight is far above the cap.
    raw = torch.exp((old_lp - rollout_lp).clamp(-50.0, 50.0))
    raw = torch.where(valid, raw, torch.ones_like(raw))
    over = (raw > cap) & valid
    ones = torch.ones_like(raw)
    if mode == "tis":
        applied, keep = torch.clamp(raw, max=cap), ones
    elif mode == "mis":
        applied, keep = torch.where(over, torch.zeros_like(raw), raw), (~over).to(raw.dtype)
    else:
        applied, keep = ones, ones
    m = valid.to(raw.dtype)
    stats = {
        "is_tokens": float(m.sum()),
        "is_sum": float((raw * m).sum()),
        "is_applied_sum": float((applied * m).sum()),
        "is_over_cap": float(over.sum()),
        "is_max": float(raw[valid].max()) if bool(valid.any()) else 0.0,
    }
    return ISWeights(applied=applied, keep=keep, raw=raw, stats=stats)


def is_metrics(sums: dict[str, float], is_max: float, mode: str) -> dict[str, float]:
    """metrics.jsonl keys from the all-reduced sums (CONTRACTS "Trainer")."""
    n = sums["is_tokens"]
    frac = sums["is_over_cap"] / n if n else 0.0
    return {
        "rollout_is_mean": sums["is_sum"] / n if n else float("nan"),
        "rollout_is_max": is_max if n else float("nan"),
        "rollout_is_applied_mean": sums["is_applied_sum"] / n if n else float("nan"),
        "rollout_is_over_cap_frac": frac,
        "rollout_is_truncated_frac": frac if mode == "tis" else 0.0,
        "rollout_is_masked_frac": frac if mode == "mis" else 0.0,
    }
