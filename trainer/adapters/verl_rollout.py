"""verl's rollout replaced by judged Hindsight samples: an ``AgentLoopManager`` that leases instead of generating.

Role: verl 0.9.1 builds a training step from ``AgentLoopManager.generate_sequences(prompts) -> DataProto``
(named by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``). :class:`HindsightAgentLoopManager`
answers it with ``len(prompts)`` samples leased from the policy server (trainer.lease_client), each turned
into verl's own ``AgentLoopOutput`` and padded and stacked by verl's own ``AgentLoopWorker`` code, so the
batch is exactly what verl's rollout would hand its trainer:

- ``prompts`` / ``responses``: the sample's ``prompt_ids`` / ``response_ids`` (left / right padded by verl);
- ``response_mask``: the sample's ``loss_mask``; ``rollout_log_probs``: its ``rollout_logprobs``;
- ``rm_scores`` (verl's token-level score, summed by its outcome estimators): the ``reward`` on the last
  response token (verl's ``reward_score``) plus the process ``token_rewards`` on each token;
- ``teacher_ids`` / ``teacher_logprobs`` (verl's distillation fields, (L, 1) per sequence): the sample's
  teacher log-prob of response token t on row ``P - 1 + t`` with the id it scores, the row layout verl's
  teacher loop writes and its distillation losses read; present when every sample of the step has them;
- non-tensor ``hindsight_sample_id`` / ``hindsight_mode`` / ``hindsight_weight_version`` /
  ``hindsight_staleness`` (weight updates since the version that sampled it, when versions are integers).

What a step requires (:class:`VerlLeaseSettings` ``require``): ``reward`` (the sample must have a reward;
Hindsight modes rl and combine), ``teacher`` (it must have teacher log-probs; ``rm_scores`` are 0, which
gives a zero advantage under verl's outcome estimators, so only verl's distillation loss trains; mode opd),
or ``both``. A sample that lacks what the step requires, or breaks the Sample contract, is set aside with
the reason (logged, acked with its lease, never given a made-up value) and another is leased in its place.

Acks: verl calls ``generate_sequences`` for step k+1 only after step k's update, so the leases of step k are
acked then (and by :meth:`HindsightAgentLoopManager.ack_pending`, for a caller that acks at its checkpoints).
Validation batches are refused: they would consume live samples (set ``trainer.test_freq=-1``,
``trainer.val_before_train=False``). Each step's samples must be independent rows: ``rollout.n`` must be 1,
since verl groups its repeats by the dataset prompt's ``uid``, which leased turns do not share.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
)
from verl.utils.ray_utils import auto_await

from engine.records import Sample
from trainer.lease_client import (
    LeasedBatch,
    PolicyClient,
    PolicyRejected,
    SampleSource,
    SetAside,
    SourceExhausted,
    TrainerError,
    collect_leases,
    leased_batch,
    staleness,
)
from trainer.sample_tensors import SampleTensors, SampleUnusable, sample_tensors

logger = logging.getLogger(__name__)

Require = Literal["reward", "teacher", "both"]


class HindsightVerlError(TrainerError):
    """verl asked for something leased samples cannot give (a validation batch, grouped repeats)."""


@dataclass(frozen=True)
class VerlLeaseSettings:
    """Where and how the manager leases; read from ``HINDSIGHT_*`` environment variables by default
    (verl builds the manager from its own config, which has no place for ours)."""

    policy_url: str = "http://127.0.0.1:8000"
    admin_api_key: str = ""
    require: Require = "reward"
    lease_wait_s: float = 30.0  # one collect's wait; the manager keeps leasing until the step is full

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> VerlLeaseSettings:
        e = os.environ if env is None else env
        require = e.get("HINDSIGHT_REQUIRE", "reward")
        if require not in ("reward", "teacher", "both"):
            raise HindsightVerlError(f"HINDSIGHT_REQUIRE must be reward, teacher or both, got {require!r}")
        return cls(
            policy_url=e.get("HINDSIGHT_POLICY_URL", cls.policy_url),
            admin_api_key=e.get("HINDSIGHT_ADMIN_KEY", ""),
            require=require,  # type: ignore[arg-type]
            lease_wait_s=float(e.get("HINDSIGHT_LEASE_WAIT_S", cls.lease_wait_s)),
        )


def missing_signal(sample: Sample, require: Require) -> str | None:
    """Why ``sample`` cannot serve a step that requires ``require``, or None."""
    if require in ("reward", "both") and not (sample.has_reward and sample.reward is not None):
        return f"no reward (the step requires {require})"
    if require in ("teacher", "both") and not (sample.has_teacher and sample.teacher_logprobs):
        return f"no teacher log-probs (the step requires {require})"
    return None


def teacher_rows(t: SampleTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logprobs), each (P + R, 1): row ``P - 1 + j`` holds response token j and its teacher log-prob,
    the layout of verl's teacher loop (row i scores sequence token i + 1; the last row is padding)."""
    assert t.teacher_logprobs is not None
    seq = torch.cat([t.prompt_ids, t.response_ids])
    ids = torch.zeros(seq.numel(), 1, dtype=torch.int32)
    ids[:-1, 0] = seq[1:].to(torch.int32)
    lps = torch.zeros(seq.numel(), 1)
    p = t.prompt_ids.numel()
    lps[p - 1 : p - 1 + t.response_ids.numel(), 0] = t.teacher_logprobs
    return ids, lps


def agent_loop_output(
    sample: Sample, t: SampleTensors, *, require: Require, with_teacher: bool, current_version: int | None
) -> AgentLoopOutput:
    """One leased sample as verl's ``AgentLoopOutput`` (token rewards are added after padding)."""
    extra: dict[str, Any] = {
        "hindsight_sample_id": sample.sample_id,
        "hindsight_mode": sample.mode,
        "hindsight_weight_version": sample.weight_version,
        "hindsight_staleness": None if current_version is None else staleness(sample, current_version),
    }
    if with_teacher:
        extra["teacher_ids"], extra["teacher_logprobs"] = teacher_rows(t)
    # "teacher" steps carry no outcome term: a zero score, which verl's outcome estimators turn into A = 0.
    score = 0.0 if require == "teacher" else t.reward
    return AgentLoopOutput(
        prompt_ids=t.prompt_ids.tolist(),
        response_ids=t.response_ids.tolist(),
        response_mask=t.loss_mask.tolist(),
        response_logprobs=t.rollout_logprobs.tolist(),
        reward_score=score,
        num_turns=2,
        metrics=AgentLoopMetrics(),
        extra_fields=extra,
    )


class HindsightBatchPacker(AgentLoopWorker):
    """verl's own ``AgentLoopWorker``, used only for its padding and stacking: no generation, and no teacher
    call (the leased samples already carry the teacher log-probs)."""

    async def _compute_teacher_logprobs(self, output: Any, *args: Any, **kwargs: Any) -> None:
        return None

    async def pack(self, outputs: list[AgentLoopOutput], token_rewards: list[torch.Tensor | None]) -> DataProto:
        padded = [await self._agent_loop_postprocess(o, False, raw_prompt=[]) for o in outputs]
        data = self._postprocess(padded, input_non_tensor_batch=None, validate=False)
        if "rm_scores" in data.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
            for i, tr in enumerate(token_rewards):
                if tr is not None:
                    data.batch["rm_scores"][i, : tr.numel()] += tr
        return data


class HindsightAgentLoopManager(AgentLoopManager):
    """``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` for training verl on Hindsight samples."""

    def __init__(
        self,
        config: Any,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        source: SampleSource | None = None,
        settings: VerlLeaseSettings | None = None,
    ):
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        self.settings = settings or VerlLeaseSettings.from_env()
        self.source = source or PolicyClient(self.settings.policy_url, self.settings.admin_api_key)
        self.pending: list[LeasedBatch] = []  # leased for the step verl is running, acked by the next call
        self.set_aside: list[SetAside] = []  # every sample set aside so far (also logged)

    async def _init_agent_loop_workers(self) -> None:
        # No rollout workers: one in-process packer (verl's worker code) builds the batch.
        self.agent_loop_workers: list[Any] = []
        self.packer = HindsightBatchPacker(self.config, self.llm_client, self.teacher_client, None)

    def ack_pending(self) -> None:
        """Acks every lease handed to verl so far (call once the step that used them is saved). A refused ack
        (the lease expired while the step was filled or trained) is logged, not raised: its samples went back to
        the server's pool and may be trained again, which a longer ``--lease-timeout-s`` avoids."""
        while self.pending:
            batch = self.pending.pop(0)
            for lease in batch.leases:
                try:
                    self.source.ack(lease.lease_id)
                except PolicyRejected as exc:
                    logger.warning("ack of lease %s refused: %s", lease.lease_id, exc)

    def _lease_step(self, n: int) -> tuple[list[Sample], list[SampleTensors]]:
        """Exactly ``n`` usable samples, leasing again in place of every sample set aside."""
        samples: list[Sample] = []
        tensors: list[SampleTensors] = []
        while len(samples) < n:
            try:
                leases = collect_leases(self.source, n - len(samples), n - len(samples), self.settings.lease_wait_s)
            except SourceExhausted as exc:
                raise SourceExhausted(f"{exc}: {len(samples)} of the {n} samples of the step were usable") from exc
            if not leases:
                continue
            got = leased_batch(self.source, leases)
            self.pending.append(got)
            aside = list(got.set_aside)
            for s in got.samples:
                why = missing_signal(s, self.settings.require) or self._too_long(s)
                if why is None:
                    try:
                        tensors.append(sample_tensors(s))
                        samples.append(s)
                        continue
                    except SampleUnusable as exc:
                        why = str(exc)
                aside.append(SetAside(s.sample_id, why))
            for a in aside:
                logger.warning("sample %s set aside: %s", a.sample_id, a.reason)
            self.set_aside.extend(aside)
        return samples, tensors

    def _too_long(self, sample: Sample) -> str | None:
        # verl pads every row to its configured lengths and never truncates: a longer sample cannot be packed.
        p, r = len(sample.prompt_ids or []), len(sample.response_ids or [])
        limit_p, limit_r = int(self.rollout_config.prompt_length), int(self.rollout_config.response_length)
        if p > limit_p or r > limit_r:
            return f"{p} prompt / {r} response ids exceed verl's prompt_length {limit_p} / response_length {limit_r}"
        return None

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """``len(prompts)`` leased samples as verl's rollout batch (the prompts' contents are not used)."""
        if prompts.meta_info.get("validate", False):
            raise HindsightVerlError(
                "validation batches are not served from leased samples: set trainer.test_freq=-1 and "
                "trainer.val_before_train=False"
            )
        uid = prompts.non_tensor_batch.get("uid")
        if uid is not None and len(set(uid.tolist())) != len(uid):
            raise HindsightVerlError("leased samples are independent rows: set actor_rollout_ref.rollout.n=1")
        self.ack_pending()  # verl finished the step that used them before asking for this one
        samples, tensors = await asyncio.to_thread(self._lease_step, len(prompts))
        step = prompts.meta_info.get("global_steps")
        current = int(step) if isinstance(step, (int, np.integer)) and step >= 0 else None
        with_teacher = all(t.teacher_logprobs is not None for t in tensors)
        if not with_teacher and any(t.teacher_logprobs is not None for t in tensors):
            # verl stacks teacher rows only when every row has them; a partial step trains without them.
            logger.info("teacher log-probs not passed to verl: only some samples of this step have them")
        outputs = [
            agent_loop_output(s, t, require=self.settings.require, with_teacher=with_teacher, current_version=current)
            for s, t in zip(samples, tensors, strict=True)
        ]
        # The outcome reward travels as verl's reward_score; the process rewards are added after padding.
        process = [t.process_rewards if self.settings.require != "teacher" else None for t in tensors]
        data = await self.packer.pack(outputs, process)
        versions = [s.weight_version for s in samples]
        data.meta_info["hindsight"] = {
            "lease_ids": [lid for b in self.pending for lid in b.lease_ids],
            "weight_versions": sorted({str(v) for v in versions}),
            "set_aside": len(self.set_aside),
        }
        data.meta_info["timing"] = self._performance_metrics([data.meta_info.pop("metrics")], data)
        return data
