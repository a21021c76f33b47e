"""An in-process ``SampleSource`` that samples from the CURRENT policy weights: the honest learning proof.

It plays the policy server's role for the trainer tests: ``lease`` renders scripted
user prompts with the chat template (engine.chat.render_prompt_ids), samples replies at ``temperature`` (1 by
default; no top-k/top-p) and records, as SGLang does, log softmax(logits / T) of each sampled token as
``rollout_logprobs`` and ``{"temperature", "max_new_tokens"}`` as ``sampling_params``; scores them with
a deterministic ``reward_fn(response_ids) -> float | None`` and, with a teacher folder, attaches teacher
log-probs (and optionally top-K) of the sampled reply: each an :class:`engine.records.Sample`, leased as its JSON.
``update_weights`` reloads the policy from the checkpoint folder, as an engine's update_weights_from_disk
would, so later leases come from the trained weights. ``ack`` records acked leases; an unacked lease is
re-served on the next ``lease`` call only if ``replay_unacked`` is set (to exercise duplicate handling).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.chat import load_tokenizer, render_prompt_ids
from engine.records import Mode, Sample, SampleJSON, TeacherTopK, WeightsPushed

if TYPE_CHECKING:
    from trainer.lease_client import Lease


def target_reward(target_ids: set[int]) -> Callable[[list[int]], float]:
    """+1 when the reply contains any target token, else -1 (a deterministic, binary PRM-like score)."""
    return lambda ids: 1.0 if target_ids.intersection(ids) else -1.0


class LocalSampleSource:
    def __init__(
        self,
        model_path: str | Path,
        prompts: list[str],
        *,
        reward_fn: Callable[[list[int]], float | None] | None = None,
        teacher_path: str | Path | None = None,
        mode: Mode = "rl",
        max_new_tokens: int = 12,
        teacher_topk: int = 0,
        seed: int = 0,
        temperature: float = 1.0,
        replay_unacked: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.tokenizer = load_tokenizer(str(model_path))
        self.eos_id = self.tokenizer.eos_token_id
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.mode = mode
        self.max_new_tokens = max_new_tokens
        self.teacher_topk = teacher_topk
        if not temperature > 0:
            raise ValueError("temperature must be > 0")
        self.temperature = float(temperature)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.policy = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.teacher = (
            AutoModelForCausalLM.from_pretrained(str(teacher_path), dtype=torch.float32).eval()
            if teacher_path
            else None
        )
        self.weight_version = "0"
        self.replay_unacked = replay_unacked
        self.leases: dict[str, list[SampleJSON]] = {}
        self.acked: list[str] = []
        self.weight_updates: list[tuple[str, str]] = []

    @torch.no_grad()
    def sample_replies(
        self, prompts_ids: list[list[int]], model: torch.nn.Module | None = None
    ) -> list[tuple[list[int], list[float]]]:
        """Batched ancestral sampling at ``self.temperature`` -> per prompt (response ids incl. EOS if reached, log-probs).

        Prompts are left-padded with explicit position ids, so each row sees exactly its own prompt.
        """
        model = model or self.policy
        B, P = len(prompts_ids), max(len(p) for p in prompts_ids)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((B, P), pad, dtype=torch.long)
        attn = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts_ids):
            ids[i, P - len(p) :] = torch.tensor(p)
            attn[i, P - len(p) :] = 1
        outs: list[tuple[list[int], list[float]]] = [([], []) for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        for _ in range(self.max_new_tokens):
            # No KV cache: replies are a few tokens long and the full forward keeps this version-proof.
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, -1].float()
            lp = torch.log_softmax(logits / self.temperature, -1)  # (B, V), the engine's temperature-scaled log-probs
            tok = torch.multinomial(lp.exp(), 1, generator=self.gen)[:, 0]  # (B,)
            for i in range(B):
                if not done[i]:
                    outs[i][0].append(int(tok[i]))
                    outs[i][1].append(float(lp[i, tok[i]]))
            done |= tok == self.eos_id
            if bool(done.all()):
                break
            ids = torch.cat([ids, torch.where(done, pad, tok)[:, None]], 1)
            attn = torch.cat([attn, (~done).long()[:, None]], 1)
        return outs

    @torch.no_grad()
    def _teacher_scores(self, prompt_ids: list[int], resp: list[int]) -> tuple[list[float], TeacherTopK | None]:
        assert self.teacher is not None
        ids = torch.tensor([prompt_ids + resp])
        logits = self.teacher(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # (R, V)
        lp = torch.log_softmax(logits, -1)
        tok_lp = lp.gather(-1, torch.tensor(resp)[:, None])[:, 0].tolist()
        topk = None
        if self.teacher_topk:
            v, i = lp.topk(self.teacher_topk, -1)
            topk = TeacherTopK(ids=i.tolist(), logprobs=v.tolist())
        return tok_lp, topk

    def prompt_ids(self, prompt: str) -> list[int]:
        return render_prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}])

    def make_samples(self, prompts: list[str]) -> list[SampleJSON]:
        p_ids = [self.prompt_ids(p) for p in prompts]
        return [self._sample(p, r, lp) for p, (r, lp) in zip(p_ids, self.sample_replies(p_ids), strict=True)]

    def _sample(self, p_ids: list[int], resp: list[int], lps: list[float]) -> SampleJSON:
        reward = self.reward_fn(resp) if self.reward_fn else None
        t_lp, topk = self._teacher_scores(p_ids, resp) if self.teacher is not None else (None, None)
        return Sample(
            mode=self.mode,
            loss_mask=[1] * len(resp),
            reward=reward,
            has_reward=reward is not None,
            has_teacher=t_lp is not None,
            prm=None,
            hint=None,
            teacher_logprobs=t_lp,
            teacher_topk=topk,
            token_rewards=None,
            w_rl=1.0,
            w_opd=1.0,
            prompt_ids=p_ids,
            response_ids=resp,
            rollout_logprobs=lps,
            weight_version=self.weight_version,
            sampling_params={"temperature": self.temperature, "max_new_tokens": self.max_new_tokens},
            sample_id=uuid.uuid4().hex,
            session_id="local",
            turn_index=0,
            created_at=time.time(),
        ).to_json()

    def lease(self, max_samples: int, wait_s: float = 0.0, min_samples: int = 1) -> Lease:
        from trainer.lease_client import Lease

        if self.replay_unacked:
            for lease_id, samples in list(self.leases.items()):
                if lease_id not in self.acked:  # an "expired" lease comes back under a new id
                    del self.leases[lease_id]
                    new_id = uuid.uuid4().hex
                    self.leases[new_id] = samples
                    return Lease(new_id, samples)
        samples = self.make_samples([self.rng.choice(self.prompts) for _ in range(max_samples)])
        lease_id = uuid.uuid4().hex
        self.leases[lease_id] = samples
        return Lease(lease_id, samples)

    def ack(self, lease_id: str) -> None:
        self.acked.append(lease_id)

    def update_weights(self, model_path: str, weight_version: str, lineage: object = None) -> WeightsPushed:
        from transformers import AutoModelForCausalLM

        self.policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.weight_version = weight_version
        self.weight_updates.append((model_path, weight_version))
        return WeightsPushed(success=True, weight_version=weight_version, paused_s=0.0, state="live")
