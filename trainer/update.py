"""One PPO update on a leased batch: plan the minibatches, recompute old log-probs, run the clipped updates.

``train_on_batch`` reads top-down as its steps:

  1. ``classify_samples``: which samples are trained (valid, not a no-EOS sample when that is masked, some
     loss-mask token) and which are idle (invalid, or no learning term in the configured mode: trained with
     mask 0 so they never dilute the denominators).
  2. RL advantages r - b (trainer/baselines.py: a running baseline by default, optional /std) on the WHOLE
     batch on every rank, so DDP ranks agree; only trained samples with a reward enter the baseline.
  3. ``plan_minibatches``: minibatch m takes samples m, m + M, ...; each is split across ranks, then into
     micro-batches. The loss denominators are the minibatch's global valid tokens and sequences, so
     micro-batching and sharding do not change the loss; zero-mask dummy rows keep the backward counts equal
     on every rank.
  4. The old log-probs (trainer/old_pass.py): one no-grad pass in eval mode before any update. It gives the PPO
     old log-probs (the recomputation, or the rollout's by setting, except for ``constrained`` samples), the
     T = 1 old log-probs of the OPD term, the rollout importance weights and the train-vs-rollout gap. With
     ``--rollout-correction mis`` rejected tokens leave the denominators too (counted over all ranks). An
     on-policy step (one epoch, one minibatch, one micro-batch per rank, no dropout) reads them from the update's
     own forward instead, detached: one forward fewer.
  5. ``run_ppo_epochs``: ppo_epochs x minibatches optimizer steps of PPO-clip; each micro-batch's advantage
     is the outcome advantage shaped by its process rewards; the loss is multiplied by world size because
     DDP averages gradients.
  6. ``summarize``: statistics summed over ranks and normalised into the step's metrics.

A batch that cannot move the weights (no trained token; every advantage 0 and no auxiliary loss term) is no
update: ``train_on_batch`` returns None before any optimizer step (``has_gradient``), because Adam with a zero
gradient still moves every weight by its momentum.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from engine.records import Sample
from trainer import parallel
from trainer.advantages import RunningMean, rl_sample_advantages
from trainer.batch import Micro, Minibatch, Scored, collate
from trainer.objective import (
    OLD_STAT_KEYS,
    STAT_KEYS,
    carries_learning_term,
    micro_loss,
    new_stats,
    outcome_advantages,
    shape,
    shaping_mask,
)
from trainer.old_pass import (
    SEQS,
    TOKENS,
    TOPK_SEQS,
    TOPK_TOKENS,
    OldPass,
    compute_old_logprobs,
    fused_old_pass,
    fuses_old_pass,
)
from trainer.rollout_correction import is_metrics, sample_temperature
from trainer.settings import TrainConfig


def classify_samples(
    samples: list[Sample], invalid: list[bool], cfg: TrainConfig, eos_id: int | None
) -> tuple[torch.Tensor, list[bool]]:
    """(B,) bool: trained samples (a sample that is not trained does not enter the baseline), and per sample
    whether it is idle (trained with mask 0: invalid, or no learning term in this mode)."""
    no_eos = [cfg.mask_no_eos_with_zero and (not s.response_ids or s.response_ids[-1] != eos_id) for s in samples]
    trained = [not bad and not ne and any(s.loss_mask) for s, bad, ne in zip(samples, invalid, no_eos, strict=True)]
    # A sample without a single trained token (masked truncation, all-zero loss mask) is idle like an invalid one.
    idle = [not ok or not carries_learning_term(s, cfg) for s, ok in zip(samples, trained, strict=True)]
    return torch.tensor(trained), idle


def sample_rewards(samples: list[Sample], trainable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) float rewards (0 where absent) and (B,) bool: trained samples that carry a reward."""
    rewards = torch.tensor(
        [s.reward if ok and s.reward is not None else 0.0 for s, ok in zip(samples, trainable.tolist(), strict=True)]
    )
    has_reward = torch.tensor([s.has_reward and s.reward is not None for s in samples]) & trainable
    return rewards, has_reward


def _turn_index(s: Sample) -> int:
    return -1 if s.turn_index is None else s.turn_index


def plan_minibatches(
    samples: list[Sample],
    idle: list[bool],
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    eos_id: int | None,
) -> list[Minibatch]:
    """Split the batch into cfg.minibatches minibatches (at most one per sample: a live step may hold fewer
    samples than minibatches), this rank's share of each into micro-batches."""
    num_samples = len(samples)
    num_minibatches = min(cfg.minibatches, num_samples)
    plan = []
    for members in (list(range(m, num_samples, num_minibatches)) for m in range(num_minibatches)):
        mask = collate(
            [samples[i] for i in members],
            eos_id=eos_id,
            mask_no_eos=cfg.mask_no_eos_with_zero,
            zero_mask=[idle[i] for i in members],
        ).mask
        num_tokens, num_seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
        mine = members[rank::world]
        if cfg.merge_trajectories:  # a session's turns side by side, so they land in one micro-batch and merge
            mine.sort(key=lambda i: (str(samples[i].session_id), _turn_index(samples[i]), i))
        # Every rank runs as many micro-batches as the rank with the largest share, so DDP backward counts agree.
        num_micros = max(1, math.ceil(math.ceil(len(members) / world) / cfg.micro_batch_size))
        micros = []
        for j in range(num_micros):
            rows = mine[j * cfg.micro_batch_size : (j + 1) * cfg.micro_batch_size]
            dummy = not rows
            rows = rows or [members[0]]
            batch = collate(
                [samples[i] for i in rows],
                eos_id=eos_id,
                mask_no_eos=cfg.mask_no_eos_with_zero,
                zero_mask=[dummy or idle[i] for i in rows],
                merge=cfg.merge_trajectories,
            ).to(device)
            micros.append(Micro(batch, [-1] * len(rows) if dummy else rows))
        plan.append(Minibatch(num_tokens, num_seqs, micros))
    return plan


def count_after_rejection(plan: list[Minibatch], counts: torch.Tensor) -> list[Minibatch]:
    """The plan with each minibatch's denominators replaced by the global counts after mis rejection."""
    return [Minibatch(float(counts[k, TOKENS]), float(counts[k, SEQS]), mb.micros) for k, mb in enumerate(plan)]


def has_gradient(
    plan: list[Minibatch], old_pass: OldPass, rl_adv: torch.Tensor, cfg: TrainConfig, world: int, with_ref: bool
) -> bool:
    """Whether the update would move the weights: some trained token has a non-zero advantage (after shaping),
    or an auxiliary term acts on a trained token (entropy bonus, KL to the reference, top-K teacher term).

    Otherwise every loss term is 0 and an optimizer step would only replay Adam's momentum: the caller skips
    the step. Decided on every rank alike (max over ranks)."""
    signal = 0.0
    for minibatch, olds in zip(plan, old_pass.olds, strict=True):
        for micro, old in zip(minibatch.micros, olds, strict=True):
            batch = micro.batch
            if not bool(batch.mask.any()):
                continue
            aux = (
                cfg.entropy_coef > 0 or with_ref or (cfg.topk_coef > 0 and bool((batch.topk_valid * batch.mask).any()))
            )
            row_adv = rl_adv[torch.tensor([max(i, 0) for i in micro.sample_index])].to(batch.mask.device)
            adv = shape(batch, outcome_advantages(batch, old.adv, row_adv, cfg), cfg)
            if aux or bool(((adv != 0) & (batch.mask > 0)).any()):
                signal = 1.0
    if world > 1:
        flag = torch.tensor([signal], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signal = float(flag[0])
    return signal > 0


def run_ppo_epochs(
    ddp: torch.nn.Module,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    opt: torch.optim.Optimizer,
    plan: list[Minibatch],
    old_pass: OldPass,
    rl_adv: torch.Tensor,
    cfg: TrainConfig,
    world: int,
    device: torch.device,
    scores: Scored | None = None,
) -> tuple[dict[str, Any], list[float]]:
    """ppo_epochs x minibatches optimizer steps; returns this rank's summed statistics and each step's grad norm.
    ``scores``: the single micro-batch's forward, already run with its graph (trainer.old_pass.fused_old_pass)."""
    stats = new_stats()
    grad_norms = []
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    for _ in range(cfg.ppo_epochs):
        for k, (minibatch, olds) in enumerate(zip(plan, old_pass.olds, strict=True)):
            for j, (micro, old) in enumerate(zip(minibatch.micros, olds, strict=True)):
                batch = micro.batch
                row_adv = rl_adv[torch.tensor([max(i, 0) for i in micro.sample_index])].to(device)
                unshaped = outcome_advantages(batch, old.adv, row_adv, cfg)
                adv = shape(batch, unshaped, cfg)
                reward_mask = shaping_mask(batch)
                stats["adv_unshaped"] += float(unshaped.sum())
                stats["adv_unshaped_abs"] += float(unshaped.abs().sum())
                stats["tr_tokens"] += float(reward_mask.sum())
                stats["tr_sum"] += float((batch.token_rewards * reward_mask).sum())
                last = j == len(minibatch.micros) - 1  # gradients are synchronised once per minibatch
                with parallel.grad_sync(ddp, cfg.parallel, world, enabled=last):
                    loss, micro_stats = micro_loss(
                        ddp,
                        ref_model,
                        batch,
                        old.pg,
                        adv,
                        cfg,
                        num_tokens=minibatch.num_tokens,
                        num_seqs=minibatch.num_seqs,
                        is_weight=old.is_weight,
                        num_topk_tokens=float(old_pass.counts[k, TOPK_TOKENS]),
                        num_topk_seqs=float(old_pass.counts[k, TOPK_SEQS]),
                        scores=scores,
                    )
                    (loss * world).backward()  # DDP/FSDP2 average gradients over ranks; the shares are already global
                for key, value in micro_stats.items():
                    stats[key] += value
            total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            grad_norms.append(parallel.grad_norm(total_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return stats, grad_norms


def summarize(
    samples: list[Sample],
    invalid: list[bool],
    idle: list[bool],
    trainable: torch.Tensor,
    rewards: torch.Tensor,
    has_reward: torch.Tensor,
    rl_adv: torch.Tensor,
    stats: dict[str, Any],
    old_pass: OldPass,
    grad_norms: list[float],
    ref_model: torch.nn.Module | None,
    cfg: TrainConfig,
    world: int,
) -> dict[str, Any]:
    """The step's metrics: statistics summed over ranks (shares of the loss sum to the batch loss), per token."""
    vec = torch.tensor([stats[k] for k in STAT_KEYS] + [old_pass.sums[k] for k in OLD_STAT_KEYS], dtype=torch.float64)
    vmax = torch.tensor([old_pass.is_max], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(vec)
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX)
    s = dict(zip(STAT_KEYS, vec[: len(STAT_KEYS)].tolist(), strict=True))
    o = dict(zip(OLD_STAT_KEYS, vec[len(STAT_KEYS) :].tolist(), strict=True))
    num_samples = len(samples)
    num_updates = cfg.ppo_epochs * len(old_pass.olds)  # optimizer steps actually taken (one per minibatch)
    num_tokens = max(s["tokens"], 1.0)
    out = {
        "loss": s["loss"] / num_updates,
        "pg_loss": s["pg"] / num_updates,
        "clip_frac": s["clip"] / num_tokens,
        "approx_kl": s["approx_kl"] / num_tokens,
        "entropy": s["entropy"] / num_tokens,
        "adv_mean": s["adv"] / num_tokens,
        "adv_abs_mean": s["adv_abs"] / num_tokens,
        # Before process-reward shaping (equal to adv_* when shaping is off or no sample has token_rewards).
        "adv_unshaped_mean": s["adv_unshaped"] / num_tokens,
        "adv_unshaped_abs_mean": s["adv_unshaped_abs"] / num_tokens,
        "n_with_token_rewards": sum(x.token_rewards is not None for x in samples),
        "token_reward_mean": s["tr_sum"] / s["tr_tokens"] if s["tr_tokens"] else float("nan"),
        "shaped_tokens": int(s["tr_tokens"] / cfg.ppo_epochs) if cfg.shaping != "none" else 0,
        "train_rollout_lp_abs_diff": o["gap_sum"] / max(o["gap_n"], 1.0),
        # Constrained samples are excluded from the gap above; their own mean |diff| is informational.
        "n_constrained": sum(x.constrained for x in samples),
        "constrained_rollout_lp_abs_diff": o["cgap_sum"] / o["cgap_n"] if o["cgap_n"] else float("nan"),
        "reward_mean": float(rewards[has_reward].mean()) if bool(has_reward.any()) else float("nan"),
        "n_samples": num_samples,
        "n_trained_samples": int(trainable.sum()),
        "n_invalid": int(sum(invalid)),
        "n_learning_samples": num_samples - sum(idle),
        "rl_adv_nonzero": int((rl_adv != 0).sum()),
        "n_with_reward": int(has_reward.sum()),
        "n_with_teacher": sum(x.has_teacher for x in samples),
        "n_tokens": int(s["tokens"] / cfg.ppo_epochs),
        "grad_norm": max(grad_norms),
        # Off-policy correction (rollout_is_* over valid tokens before mis rejection) and the samples' temperatures.
        **is_metrics(o, float(vmax[0]), cfg.rollout_correction),
        "n_with_sampling_params": sum(x.sampling_params is not None for x in samples),
        "sample_temperature_mean": sum(sample_temperature(x) for x in samples) / max(num_samples, 1),
    }
    if ref_model is not None:
        out["ref_kl"] = s["ref_kl"] / num_tokens
    if cfg.topk_coef > 0:
        out["topk_kl"] = s["topk_kl"] / num_tokens
    return out


def train_on_batch(
    ddp: torch.nn.Module,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    opt: torch.optim.Optimizer,
    samples: list[Sample],
    invalid: list[bool],
    cfg: TrainConfig,
    running: RunningMean,
    rank: int,
    world: int,
    device: torch.device,
    eos_id: int | None,
) -> dict[str, Any] | None:
    """One PPO update on ``samples`` (the same list on every rank; ``invalid`` ones are trained with mask 0).

    ``ddp`` is the wrapped model the loss runs through, ``model`` the plain one whose parameters are clipped;
    ``running`` is the baseline state, updated in place (also when the step is skipped: the rewards were seen).
    Returns the step's metrics (summed over ranks), or None when nothing would move the weights (no trained
    token, or every advantage 0 with no auxiliary term): then no optimizer step ran, Adam's state is as before."""
    trainable, idle = classify_samples(samples, invalid, cfg, eos_id)
    rewards, has_reward = sample_rewards(samples, trainable)
    rl_adv = rl_sample_advantages(
        rewards, has_reward, baseline=cfg.baseline, normalize=cfg.normalize_advantages, running=running
    )
    plan = plan_minibatches(samples, idle, cfg, rank, world, device, eos_id)
    if all(minibatch.num_tokens == 0 for minibatch in plan):  # global counts: every rank agrees
        return None
    scores = None
    if fuses_old_pass(model, plan, cfg):  # on-policy: the update's own forward gives the old log-probs
        old_pass, scores = fused_old_pass(ddp, plan, cfg, world)
    else:
        old_pass = compute_old_logprobs(model, plan, cfg, world)
    if cfg.rollout_correction == "mis":
        plan = count_after_rejection(plan, old_pass.counts)
    if not has_gradient(plan, old_pass, rl_adv, cfg, world, with_ref=ref_model is not None):
        return None  # a fused forward's graph is dropped: DDP (no unused-parameter search) accepts a forward alone
    stats, grad_norms = run_ppo_epochs(
        ddp, model, ref_model, opt, plan, old_pass, rl_adv, cfg, world, device, scores=scores
    )
    metrics = summarize(
        samples,
        invalid,
        idle,
        trainable,
        rewards,
        has_reward,
        rl_adv,
        stats,
        old_pass,
        grad_norms,
        ref_model,
        cfg,
        world,
    )
    metrics.update(forward_token_metrics(samples, plan, world, device))
    metrics["old_pass_fused"] = int(scores is not None)  # the old log-probs came from the update's own forward
    return metrics


def forward_token_metrics(
    samples: list[Sample], plan: list[Minibatch], world: int, device: torch.device
) -> dict[str, float]:
    """Tokens one forward pass over the batch runs (all ranks; dummy rows left out), per turn, next to what
    separate prompt + response sequences would run: merged trajectories make the first smaller."""
    ran = sum(
        float(micro.batch.attention_mask.sum())
        for minibatch in plan
        for micro in minibatch.micros
        if micro.sample_index and micro.sample_index[0] >= 0
    )
    total = torch.tensor([ran], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(total)
    separate = sum(len(s.prompt_ids or []) + len(s.response_ids or []) for s in samples)
    n = max(len(samples), 1)
    return {
        "forward_tokens": float(total[0]),
        "forward_tokens_per_turn": float(total[0]) / n,
        "separate_tokens_per_turn": separate / n,
    }
