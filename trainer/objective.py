"""The per-micro-batch objective: which advantage each sample gets, and the loss with its statistics.

``token_advantages`` routes each sample to its advantage (docs/CONTRACTS.md: the trainer applies only the
terms a sample has). With ``advantage_mode="sample"`` a sample's own ``mode`` field decides:
rl -> A_rl broadcast; opd -> teacher - old; combine -> w_opd (teacher - old) + w_rl A_rl. The global modes
``prm_gated_opd`` / ``multiplicative`` need both a PRM reward and teacher log-probs (one step per turn);
samples lacking either get A = 0 and are counted. AReaL shaping of ``token_rewards`` runs last, only on
samples that carry token rewards (others are inactive rows and keep A): ``outcome_advantages`` then
``shape``; the loop logs both, so the effect of shaping is visible in metrics.jsonl.

Old log-probs (``select_old_logprobs``): the trainer's recomputation, or with ``--old-logprobs rollout`` the
rollout's, EXCEPT for ``constrained`` samples (forced tool calls decoded under a regex mask): their rollout
log-probs are log p(token | allowed), several nats above the model's own, so they would bias both the PPO
ratio and teacher - old; those rows always take the recomputation.

Off-policy correction (trainer/rollout_correction.py): ``micro_loss`` takes the PPO old log-probs at the loss
temperature (T = 1, or each sample's temperature with ``--logprob-temperature sample``, in which case the new
log-probs of the PPO term are scaled the same way) and multiplies the per-token PPO term by the detached
rollout importance weight; the OPD advantage always uses T = 1 old log-probs (the teacher's temperature): with
``--old-logprobs rollout`` the rollout's only for samples drawn at T = 1, the recomputation for the others.

Denominators: a sample that carries no learning term in the configured mode (``carries_learning_term``) is
trained with mask 0 like an excluded one; the top-K term is averaged over the tokens that have teacher top-K
rows (``num_topk_tokens`` / ``num_topk_seqs``), not over every valid token.

``micro_loss`` returns this micro-batch's share of the batch loss (see loss.aggregate) and SUMS over valid
tokens for the logged statistics, so they can be all-reduced across micro-batches and ranks exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.records import Sample
from trainer.advantages import (
    broadcast_to_tokens,
    combine_advantages,
    multiplicative_opd,
    multiplicative_opd_literal,
    opd_advantages,
    prm_gated_opd,
    shape_advantages,
    turn_steps,
)
from trainer.batch import Batch, Scored, score_responses
from trainer.loss import aggregate, entropy_from_logits, low_var_kl, ppo_clip_loss, topk_reverse_kl
from trainer.rollout_correction import IS_STAT_KEYS, rollout_is_weights, temperature_logprobs
from trainer.settings import TrainConfig

# Sums of the old-log-prob pass: train-vs-rollout gap (|diff| sum, tokens) of unconstrained and constrained samples.
OLD_STAT_KEYS = ("gap_sum", "gap_n", "cgap_sum", "cgap_n", *IS_STAT_KEYS)
STAT_KEYS = (
    "tokens",
    "pg",
    "clip",
    "approx_kl",
    "entropy",
    "ref_kl",
    "topk_kl",
    "adv",
    "adv_abs",
    "loss",
    "adv_unshaped",
    "adv_unshaped_abs",
    "tr_tokens",
    "tr_sum",
)


STEP_MODES = ("prm_gated_opd", "multiplicative", "multiplicative_literal")


def carries_learning_term(s: Sample, cfg: TrainConfig) -> bool:
    """Whether a (valid) sample gives the step a learning signal in the configured mode; one that does not is
    trained with mask 0, so it dilutes no denominator (docs/REWARD_MODES.md "Denominators").

    rl: a reward, except a reward of exactly 0 under baseline ``none`` (A = 0 by construction: an at-least-one
    promoted turn); opd: teacher log-probs; combine: either term with a non-zero weight; the step modes: both.
    Token rewards under shaping and ``teacher_topk`` with ``--topk-coef`` > 0 are learning terms too."""
    has_r = s.has_reward and s.reward is not None
    has_t = s.has_teacher
    mode = (s.mode or "rl") if cfg.advantage_mode == "sample" else cfg.advantage_mode
    rl = has_r and not (cfg.baseline == "none" and s.reward == 0.0)
    if mode in STEP_MODES:
        own = has_r and has_t
    elif mode == "opd":
        own = has_t
    elif mode == "combine":
        own = (rl and s.w_rl != 0.0) or (has_t and s.w_opd != 0.0)
    else:
        own = rl
    shaped = cfg.shaping != "none" and s.token_rewards is not None
    topk = cfg.topk_coef > 0 and s.teacher_topk is not None and bool(s.teacher_topk.ids)
    return own or shaped or topk


def select_old_logprobs(
    recomputed: torch.Tensor, rollout: torch.Tensor, constrained: torch.Tensor, source: str
) -> torch.Tensor:
    """(B, T) old log-probs: ``recomputed`` / ``rollout`` are (B, T), ``constrained`` (B,) bool, source recompute|rollout."""
    if source == "recompute":
        return recomputed
    if source != "rollout":
        raise ValueError(f"old log-prob source must be recompute or rollout, got {source!r}")
    return torch.where(constrained.to(recomputed.device)[:, None], recomputed, rollout)


@dataclass
class OldLogprobs:
    pg: torch.Tensor  # (B, T) old log-probs of the PPO ratio, at the loss temperature
    adv: (
        torch.Tensor
    )  # (B, T) old log-probs of the OPD term teacher - old, at T = 1 (rollout ones only if drawn at T = 1)
    is_weight: torch.Tensor  # (B, T) rollout importance weight applied to the PPO term
    stats: dict[str, float]  # OLD_STAT_KEYS sums over valid tokens, plus is_max


@torch.no_grad()
def old_logprobs(model: torch.nn.Module, b: Batch, cfg: TrainConfig) -> OldLogprobs:
    """One micro-batch's old log-probs, gap sums and rollout importance weights, before any update: a no-grad
    forward of ``model`` read by :func:`old_logprobs_of`."""
    return old_logprobs_of(score_responses(model, b, with_entropy=False), b, cfg)


@torch.no_grad()
def old_logprobs_of(sc: Scored, b: Batch, cfg: TrainConfig) -> OldLogprobs:
    """Old log-probs, gap sums and rollout importance weights of one micro-batch from its scores under the
    weights the update starts from (``sc``: a no-grad pass, or the update's own forward, read detached).

    The gap is measured separately for constrained samples (their rollout log-probs are of the grammar-masked
    distribution, not a drift signal). With ``mis`` the rejected tokens are removed from ``b.mask`` here, so
    every later loss term and statistic of the step leaves them out (the caller fixes the denominators).
    """
    lp1 = sc.logprobs.detach()
    sample_t = cfg.logprob_temperature == "sample"
    lp = temperature_logprobs(sc.logits.detach(), b.response_ids, b.temperature) if sample_t else lp1
    diff = (lp - b.rollout_lp).abs()
    con = b.mask * b.constrained[:, None].to(b.mask.dtype)
    free = b.mask - con
    pg = select_old_logprobs(lp, b.rollout_lp, b.constrained, cfg.old_logprobs)
    w = rollout_is_weights(pg, b.rollout_lp, b.mask, cfg.rollout_correction, cfg.rollout_is_cap)
    b.mask = b.mask * w.keep  # identity unless mis rejected tokens
    stats = {
        "gap_sum": float((diff * free).sum()),
        "gap_n": float(free.sum()),
        "cgap_sum": float((diff * con).sum()),
        "cgap_n": float(con.sum()),
        **w.stats,
    }
    # The OPD term compares with the T = 1 teacher: rollout log-probs qualify only when drawn at T = 1.
    not_t1 = b.constrained | ((b.temperature - 1.0).abs() > 1e-6).to(b.constrained.device)
    return OldLogprobs(
        pg=pg, adv=select_old_logprobs(lp1, b.rollout_lp, not_t1, cfg.old_logprobs), is_weight=w.applied, stats=stats
    )


def outcome_advantages(b: Batch, old_lp: torch.Tensor, rl_adv: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """(B, T) outcome advantages before any process-reward shaping; ``rl_adv`` (B,) is the whole-batch RL term."""
    mode = cfg.advantage_mode
    mask = b.mask
    if mode in STEP_MODES:
        usable = b.has_reward & b.has_teacher
        step_ids, scores = turn_steps(mask * usable[:, None], b.reward)
        fn = {
            "prm_gated_opd": prm_gated_opd,
            "multiplicative": multiplicative_opd,
            "multiplicative_literal": multiplicative_opd_literal,
        }[mode]
        kw = {"wrong_value": cfg.gated_wrong_value} if mode == "prm_gated_opd" else {}
        adv = fn(b.teacher_lp, old_lp, step_ids, scores, **kw)
    else:
        rl = broadcast_to_tokens(torch.where(b.has_reward, rl_adv, torch.zeros_like(rl_adv)), mask)
        opd = opd_advantages(b.teacher_lp, old_lp, mask, b.has_teacher)
        comb = combine_advantages(b.teacher_lp, old_lp, rl_adv, mask, b.has_teacher, b.has_reward, b.w_opd, b.w_rl)
        modes = b.modes if mode == "sample" else [mode] * len(b.modes)
        pick = torch.tensor([{"rl": 0, "opd": 1, "combine": 2}.get(m, 0) for m in modes], device=mask.device)[:, None]
        adv = torch.where(pick == 0, rl, torch.where(pick == 1, opd, comb))
    return adv * mask


def shaping_mask(b: Batch) -> torch.Tensor:
    """(B, T) tokens the shaping acts on: loss-mask tokens of samples that carry token_rewards."""
    return b.mask * b.has_token_rewards[:, None].to(b.mask.dtype)


def shape(b: Batch, adv: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """AReaL shaping of ``adv`` with the samples' ``token_rewards`` (the process reward p_t); identity when off."""
    if cfg.shaping == "none" or not bool(b.has_token_rewards.any()):
        return adv
    out = shape_advantages(
        adv,
        b.token_rewards,
        cfg.shaping,
        negative_scale=cfg.shaping_negative_scale,
        zero_penalty=cfg.shaping_zero_penalty,
        eps=cfg.shaping_eps,
        mask=shaping_mask(b),
    )
    return out * b.mask


def token_advantages(b: Batch, old_lp: torch.Tensor, rl_adv: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """(B, T) advantages for one micro-batch: outcome advantages, then the configured shaping."""
    return shape(b, outcome_advantages(b, old_lp, rl_adv, cfg), cfg)


def micro_loss(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    b: Batch,
    old_lp: torch.Tensor,  # (B, T) PPO old log-probs at the loss temperature
    adv: torch.Tensor,  # (B, T)
    cfg: TrainConfig,
    *,
    num_tokens: float,
    num_seqs: float,
    is_weight: torch.Tensor | None = None,  # (B, T) rollout importance weight (None = 1)
    num_topk_tokens: float | None = None,  # tokens with teacher top-K rows in the optimizer batch (None = num_tokens)
    num_topk_seqs: float | None = None,
    scores: Scored | None = None,  # this micro-batch's forward through ``model`` with its graph, when already run
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss share (with grad) and summed statistics of one micro-batch."""
    need_entropy_grad = cfg.entropy_coef > 0
    sc = scores if scores is not None else score_responses(model, b, with_entropy=need_entropy_grad)
    mask = b.mask
    lp = sc.logprobs
    if cfg.logprob_temperature == "sample":
        lp = temperature_logprobs(sc.logits, b.response_ids, b.temperature)
    per_tok, clipped, _ = ppo_clip_loss(lp, old_lp, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    if is_weight is not None:
        per_tok = per_tok * is_weight.detach()
    agg = lambda x: aggregate(x, mask, cfg.aggregation, num_tokens=num_tokens, num_seqs=num_seqs)  # noqa: E731
    pg = agg(per_tok)
    loss = pg
    stats: dict[str, float] = {}
    ent = sc.entropy
    if ent is not None:  # scored with its graph exactly when the coefficient needs it
        loss = loss - cfg.entropy_coef * agg(ent)
    else:
        with torch.no_grad():  # entropy is logged always; without its coefficient it needs no graph
            ent = entropy_from_logits(sc.logits.detach())
    if ref_model is not None:
        with torch.no_grad():
            ref_lp = score_responses(ref_model, b, with_entropy=False).logprobs
        kl = low_var_kl(sc.logprobs, ref_lp)
        loss = loss + cfg.kl_coef * agg(kl)
        stats["ref_kl"] = float((kl.detach() * mask).sum())
    if cfg.topk_coef > 0 and b.topk_ids is not None and b.topk_lp is not None and bool(b.topk_valid.any()):
        tk = topk_reverse_kl(sc.logits, b.topk_ids, b.topk_lp, b.topk_valid * mask)
        tmask = b.topk_valid * mask
        loss = loss + cfg.topk_coef * aggregate(
            tk,
            tmask,
            cfg.aggregation,
            num_tokens=num_tokens if num_topk_tokens is None else num_topk_tokens,
            num_seqs=num_seqs if num_topk_seqs is None else num_topk_seqs,
        )
        stats["topk_kl"] = float((tk.detach() * tmask).sum())
    with torch.no_grad():
        d = (lp.detach() - old_lp) * mask
        stats.update(
            tokens=float(mask.sum()),
            pg=float(pg.detach()),
            loss=float(loss.detach()),
            clip=float((clipped * mask).sum()),
            approx_kl=float((0.5 * d * d).sum()),
            entropy=float((ent.detach() * mask).sum()),
            adv=float((adv * mask).sum()),
            adv_abs=float((adv.abs() * mask).sum()),
        )
    return loss, stats


def new_stats() -> dict[str, float]:
    return dict.fromkeys(STAT_KEYS, 0.0)
