"""Trainer step overhead: tokens/s of a full PPO step vs a bare forward+backward of the same model and batch.

    python -m bench.trainer_step [--model-path DIR] [--batch-size 16] [--prompt-len 64] [--response-len 64] [--iters 5]
    python -m bench.trainer_step --on-policy [...]   # also: the on-policy step, old log-probs fused vs separate

The full step is ``trainer.train.train_on_batch`` (collate, old log-prob recomputation, advantages,
PPO-clip loss with entropy logging, backward, clip, AdamW step). The bare step is one forward of the
same padded batch, a mean log-prob loss on the response tokens, backward and AdamW step. Both count
response tokens. Without --model-path a tiny seeded Qwen3 model is built in a temp folder. Prints
both rates and their ratio (bare / full: how many times slower the full step is). With ``--on-policy`` the
step is one PPO epoch over one micro-batch (``--micro-batch-size`` = the batch), measured twice side by side:
``--old-logprob-pass auto`` (the old log-probs read from the update's own forward) and ``separate`` (a no-grad
pass first), with their ratio.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from engine.records import Sample
from trainer.advantages import RunningMean
from trainer.batch import collate, score_responses
from trainer.settings import TrainConfig
from trainer.train import train_on_batch


def make_samples(vocab: int, n: int, p_len: int, r_len: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.randint(r_len // 2, r_len)
        out.append(
            Sample(
                sample_id=str(i),
                mode="combine",
                prompt_ids=[rng.randrange(vocab) for _ in range(p_len)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                rollout_logprobs=[-7.0] * r,
                loss_mask=[1] * r,
                reward=rng.choice([-1.0, 1.0]),
                has_reward=True,
                has_teacher=True,
                teacher_logprobs=[-6.5] * r,
                w_rl=1.0,
                w_opd=1.0,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--on-policy", action="store_true", help="one epoch, one micro-batch: fused vs separate old pass")
    args = ap.parse_args()
    if args.on_policy:
        args.micro_batch_size = args.batch_size
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_path = args.model_path
    tmp = tempfile.TemporaryDirectory()
    if not model_path:
        from devkit.tiny_model import build_tiny_model

        model_path = str(build_tiny_model(Path(tmp.name) / "tiny", seed=0))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    samples = make_samples(model.config.vocab_size, args.batch_size, args.prompt_len, args.response_len)
    epochs = {"ppo_epochs": 1} if args.on_policy else {}
    cfg = TrainConfig(
        model_path=model_path, out_dir="unused", micro_batch_size=args.micro_batch_size, progress=False, **epochs
    )
    separate_cfg = cfg.model_copy(update={"old_logprob_pass": "separate"})
    n_tok = sum(len(s.response_ids or []) for s in samples)

    def step(c: TrainConfig) -> None:
        train_on_batch(model, model, None, opt, samples, [False] * len(samples), c, RunningMean(), 0, 1, device, None)

    def full() -> None:
        step(cfg)

    def separate() -> None:
        step(separate_cfg)

    def bare() -> None:
        for i in range(0, len(samples), args.micro_batch_size):
            b = collate(samples[i : i + args.micro_batch_size]).to(device)
            lp = score_responses(model, b, with_entropy=False).logprobs
            (-(lp * b.mask).sum() / n_tok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rates = {}
    runs = [("bare", bare), ("full", full)] + ([("separate", separate)] if args.on_policy else [])
    for name, fn in runs + runs:  # the second round is measured
        fn()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates[name] = n_tok * args.iters / (time.perf_counter() - t0)
    print(f"model={model_path} device={device} batch={args.batch_size} response_tokens/step={n_tok}")
    print(f"bare forward+backward: {rates['bare']:.0f} tokens/s")
    print(f"full training step:    {rates['full']:.0f} tokens/s")
    print(f"ratio bare/full: {rates['bare'] / rates['full']:.2f}x")
    if args.on_policy:
        print(f"on-policy step, old log-probs from a separate pass: {rates['separate']:.0f} tokens/s")
        print(
            f"ratio fused/separate (old log-probs from the update's own forward): {rates['full'] / rates['separate']:.2f}x"
        )
    tmp.cleanup()


if __name__ == "__main__":
    main()
