"""Trainer tokens per trained turn, merged session trajectories vs separate samples.

    python -m bench.trainer_tokens [--model-dir DIR] [--prompt-tokens 30000] [--turns 10] [--check-prompt-tokens 1500]

Part 1 (counting, the issue's case): one token-continuous session of ``--turns`` turns whose first prompt
holds ``--prompt-tokens`` tokens (replies 150 tokens, new messages 60): the tokens the trainer's forward
pass runs per trained turn, from the trainer's own collate (``trainer.batch.collate``: attention-mask
tokens of its rows), separate vs ``merge=True``, and the ratio (target >= 5x fewer).
Part 2 (the same loss): the tiny model's context is 4096 tokens, so the loss is compared on the same kind of
session at ``--check-prompt-tokens``: one combine-mode micro-batch loss and gradient, separate vs merged
(max abs difference), and the CPU seconds of each forward + backward.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from devkit.tiny_model import build_tiny_model
from engine.records import Sample
from trainer.batch import collate
from trainer.objective import micro_loss, old_logprobs, token_advantages
from trainer.settings import TrainConfig


def session(prompt_tokens: int, turns: int, vocab: int = 1000, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, vocab) for _ in range(prompt_tokens)]
    out = []
    for k in range(turns):
        resp = [rng.randrange(10, vocab) for _ in range(150)]
        n = len(resp)
        out.append(
            Sample.model_validate(
                {
                    "sample_id": f"t{k}",
                    "session_id": "s",
                    "turn_index": k,
                    "mode": "combine",
                    "prompt_ids": prompt,
                    "response_ids": resp,
                    "rollout_logprobs": [-rng.uniform(3, 8) for _ in range(n)],
                    "loss_mask": [1] * n,
                    "reward": rng.choice([1.0, -1.0]),
                    "has_reward": True,
                    "teacher_logprobs": [-rng.uniform(1, 9) for _ in range(n)],
                    "has_teacher": True,
                    "w_rl": 0.5,
                    "w_opd": 1.0,
                }
            )
        )
        prompt = prompt + resp + [rng.randrange(10, vocab) for _ in range(60)]
    return out


def loss_and_grad(
    model: torch.nn.Module, samples: list[Sample], merge: bool
) -> tuple[float, list[torch.Tensor], float]:
    cfg = TrainConfig(model_path="m", out_dir="o", old_logprobs="rollout", rollout_correction="none")
    b = collate(samples, merge=merge)
    rl_adv = torch.tensor([s.reward for s in samples])  # every bench sample has one
    t0 = time.process_time()
    old = old_logprobs(model, b, cfg)
    adv = token_advantages(b, old.adv, rl_adv, cfg)
    model.zero_grad()
    loss, _ = micro_loss(model, None, b, old.pg, adv, cfg, num_tokens=float(b.mask.sum()), num_seqs=len(samples))
    loss.backward()
    cpu_s = time.process_time() - t0
    return float(loss.detach()), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None], cpu_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=30000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--check-prompt-tokens", type=int, default=1500)
    a = ap.parse_args()

    samples = session(a.prompt_tokens, a.turns)
    sep = float(collate(samples).attention_mask.sum()) / len(samples)
    mer = float(collate(samples, merge=True).attention_mask.sum()) / len(samples)
    print(f"{a.turns}-turn session, {a.prompt_tokens}-token prompt: trainer tokens per trained turn")
    print(f"  separate {sep:9.0f}   merged {mer:9.0f}   ratio {sep / mer:.1f}x fewer (target >= 5x)")

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_dir = a.model_dir or build_tiny_model(Path(tempfile.mkdtemp(prefix="hs-ttok-")) / "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    small = session(a.check_prompt_tokens, a.turns, seed=1)
    l0, g0, c0 = loss_and_grad(model, small, merge=False)
    l1, g1, c1 = loss_and_grad(model, small, merge=True)
    gdiff = max(float((x - y).abs().max()) for x, y in zip(g0, g1, strict=True))
    gmax = max(float(x.abs().max()) for x in g0)
    print(f"{a.turns}-turn session, {a.check_prompt_tokens}-token prompt, tiny model, combine mode:")
    print(
        f"  loss separate {l0:.7f}  merged {l1:.7f}  |diff| {abs(l0 - l1):.2e};  grad max |diff| {gdiff:.2e} (max |grad| {gmax:.2e})"
    )
    print(f"  forward+backward CPU s: separate {c0:.2f}  merged {c1:.2f}  ratio {c0 / c1:.1f}x")


if __name__ == "__main__":
    main()
