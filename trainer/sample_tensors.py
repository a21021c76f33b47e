"""A leased :class:`engine.records.Sample` as per-sample torch tensors, for trainers that pad and batch
themselves (verl, slime); our own trainer pads a whole step at once with :func:`trainer.batch.collate`,
re-exported here as :func:`collate` so both read the same layout. It lives with the trainer, not in the lease
client, because it is the trainer's own reading of a sample (its structural check and its OPD advantage): the
lease client stays importable alone, without torch and without the trainer.

Layout (one sample, T response ids, response-aligned):

- ``prompt_ids`` (P,) and ``response_ids`` (T,) long: exactly what the engine was sent and sampled;
- ``loss_mask`` (T,) long: 1 on trained tokens (all 0 for an excluded sample);
- ``rollout_logprobs`` (T,) float: the engine's log-prob of each sampled id;
- ``teacher_logprobs`` (T,) float or None (``has_teacher``);
- ``token_level_rewards`` (T,) float: the outcome ``reward`` on the LAST response token (where verl's
  reward managers put a sequence score, so a framework summing token rewards gets the reward back) plus the
  process ``token_rewards`` on every token (also alone as ``process_rewards``, None when the sample has
  none); zeros when the sample has neither, with ``has_reward`` false;
- ``opd_advantages`` (T,) float or None: teacher - rollout log-prob on trained tokens (0 elsewhere), the
  on-policy-distillation advantage of trainer.advantages.opd_advantages with the rollout as old policy;
- ``w_rl`` / ``w_opd``: the combine weights the sample carries; ``oldest_version``: see trainer.lease_client.samples.staleness.

The structural check is the trainer's own (trainer.batch.check_sample): a sample that fails it raises
:class:`SampleUnusable` with the same reason, never a tensor of made-up values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.records import Sample
from trainer.advantages import opd_advantages
from trainer.batch import check_sample, collate
from trainer.lease_client.client import TrainerError
from trainer.lease_client.samples import oldest_version

__all__ = ["SampleTensors", "SampleUnusable", "collate", "sample_tensors"]


class SampleUnusable(TrainerError):
    """A leased sample breaks the Sample contract (lengths, values): set it aside with this reason."""


@dataclass
class SampleTensors:
    sample_id: str | None
    mode: str | None
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor | None
    token_level_rewards: torch.Tensor
    process_rewards: torch.Tensor | None
    has_reward: bool
    reward: float | None
    opd_advantages: torch.Tensor | None
    w_rl: float
    w_opd: float
    weight_version: str | None
    oldest_version: int | None


def sample_tensors(sample: Sample) -> SampleTensors:
    """The tensors of one sample (see the module docstring); raises SampleUnusable when it breaks the contract."""
    why = check_sample(sample)
    if why:
        raise SampleUnusable(f"sample {sample.sample_id}: {why}")
    resp = torch.tensor(sample.response_ids, dtype=torch.long)
    n = resp.numel()
    mask = torch.tensor(sample.loss_mask, dtype=torch.long)
    rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    has_reward = bool(sample.has_reward) and sample.reward is not None
    rewards = torch.zeros(n)
    if has_reward:
        rewards[n - 1] += float(sample.reward or 0.0)
    process = None
    if sample.token_rewards is not None:
        process = torch.tensor(sample.token_rewards, dtype=torch.float32)
        rewards += process
    teacher = None
    opd = None
    if sample.has_teacher and sample.teacher_logprobs:
        teacher = torch.tensor(sample.teacher_logprobs, dtype=torch.float32)
        opd = opd_advantages(teacher[None], rollout[None], mask[None].float(), torch.tensor([True]))[0]
    return SampleTensors(
        sample_id=sample.sample_id,
        mode=sample.mode,
        prompt_ids=torch.tensor(sample.prompt_ids, dtype=torch.long),
        response_ids=resp,
        loss_mask=mask,
        rollout_logprobs=rollout,
        teacher_logprobs=teacher,
        token_level_rewards=rewards,
        process_rewards=process,
        has_reward=has_reward or sample.token_rewards is not None,
        reward=float(sample.reward) if has_reward and sample.reward is not None else None,
        opd_advantages=opd,
        w_rl=float(sample.w_rl),
        w_opd=float(sample.w_opd),
        weight_version=sample.weight_version,
        oldest_version=oldest_version(sample),
    )
