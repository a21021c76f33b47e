"""The old log-probs of a PPO update: what the weights the update starts from give each micro-batch.

``compute_old_logprobs`` is a no-grad pass in eval mode over every micro-batch before any optimizer step. It gives
the PPO old log-probs (the recomputation, or the rollout's by setting, except for ``constrained`` samples), the
T = 1 old log-probs of the OPD term, the rollout importance weights and the train-vs-rollout gap
(trainer.objective.old_logprobs_of). With ``--rollout-correction mis`` rejected tokens leave the denominators too
(counted over all ranks).

On-policy steps skip that pass (``fuses_old_pass``): with one PPO epoch, one minibatch and one micro-batch per
rank, the single optimizer step starts from exactly the weights the pass would read, so the update's own forward,
read detached, gives the same old log-probs (``fused_old_pass``) and the step runs one forward instead of two (a
quarter of its compute; verl does the same when its PPO step is on-policy). Only when the model has no dropout:
the separate pass runs in eval mode, the update in train mode. ``--old-logprob-pass separate`` always runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.batch import Minibatch, Scored, score_responses
from trainer.objective import OLD_STAT_KEYS, OldLogprobs, old_logprobs, old_logprobs_of
from trainer.settings import TrainConfig

# Columns of OldPass.counts: per minibatch, valid tokens and samples (after mis rejection), then the tokens and
# samples that carry teacher top-K rows (the top-K term's denominators).
TOKENS, SEQS, TOPK_TOKENS, TOPK_SEQS = range(4)
# Model config fields (Hugging Face names) of what acts only in train mode: dropout rates and MoE router jitter;
# read besides torch.nn.Dropout modules.
_TRAIN_MODE_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "router_jitter_noise",
)


@dataclass
class OldPass:
    """What the old log-probs of the update measured: per-micro old log-probs and the summed statistics."""

    olds: list[list[OldLogprobs]]  # [minibatch][micro]
    sums: dict[str, float]  # OLD_STAT_KEYS, this rank
    is_max: float  # largest rollout importance weight, this rank
    counts: torch.Tensor  # (num_minibatches, 4) float64, global when a setting needs it (see columns above)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether train mode changes the forward: a torch.nn.Dropout with p > 0, or a dropout rate (or router jitter)
    in the model's config."""
    config = getattr(model, "config", None)
    rates = [getattr(config, name, 0.0) for name in _TRAIN_MODE_FIELDS]
    if any(isinstance(r, int | float) and r > 0 for r in rates):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def fuses_old_pass(model: torch.nn.Module, plan: list[Minibatch], cfg: TrainConfig) -> bool:
    """Whether the update's own forward gives the old log-probs (module docstring); the same on every rank (the
    plan gives every rank as many micro-batches)."""
    single = cfg.ppo_epochs == 1 and len(plan) == 1 and len(plan[0].micros) == 1
    return cfg.old_logprob_pass == "auto" and single and not has_dropout(model)


def compute_old_logprobs(model: torch.nn.Module, plan: list[Minibatch], cfg: TrainConfig, world: int) -> OldPass:
    """Old log-probs of every micro-batch before any update, in eval mode so no dropout enters them."""
    model.eval()
    try:
        olds = [[old_logprobs(model, micro.batch, cfg) for micro in minibatch.micros] for minibatch in plan]
    finally:
        model.train()
    return _summed(plan, olds, cfg, world)


def fused_old_pass(net: torch.nn.Module, plan: list[Minibatch], cfg: TrainConfig, world: int) -> tuple[OldPass, Scored]:
    """The one micro-batch's forward through ``net`` (the wrapped model the loss runs through) with its graph, and
    the old log-probs read from it detached; only when :func:`fuses_old_pass`."""
    batch = plan[0].micros[0].batch
    net.train()  # the update's forward (a separate pass would have left the model in train mode too)
    scores = score_responses(net, batch, with_entropy=cfg.entropy_coef > 0)
    return _summed(plan, [[old_logprobs_of(scores, batch, cfg)]], cfg, world), scores


def _summed(plan: list[Minibatch], olds: list[list[OldLogprobs]], cfg: TrainConfig, world: int) -> OldPass:
    """The pass's statistics summed over micro-batches; the per-minibatch counts all-reduced when mis or the top-K
    term needs them (after mis rejection: old_logprobs_of has removed rejected tokens from each mask)."""
    sums = dict.fromkeys(OLD_STAT_KEYS, 0.0)
    is_max = 0.0
    counts = torch.zeros(len(plan), 4, dtype=torch.float64)
    for k, (minibatch, micro_olds) in enumerate(zip(plan, olds, strict=True)):
        for micro, old in zip(minibatch.micros, micro_olds, strict=True):
            for key in OLD_STAT_KEYS:
                sums[key] += old.stats[key]
            is_max = max(is_max, old.stats["is_max"])
            batch = micro.batch
            topk = batch.topk_valid * batch.mask
            counts[k] += torch.tensor(
                [
                    float(batch.mask.sum()),
                    float((batch.mask.sum(-1) > 0).sum()),
                    float(topk.sum()),
                    float((topk.sum(-1) > 0).sum()),
                ],
                dtype=torch.float64,
            )
    if world > 1 and (cfg.rollout_correction == "mis" or cfg.topk_coef > 0):
        dist.all_reduce(counts)
    return OldPass(olds, sums, is_max, counts)
