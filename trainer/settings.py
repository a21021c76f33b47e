"""The trainer's one configuration object: defaults defined once, argparse generated from it.

``TrainConfig`` is a frozen dataclass; each field's ``metadata["help"]`` is its CLI help. ``build_parser``
turns it into ``hindsight-train``'s flags (``--batch-size`` for ``batch_size``; booleans are
``--flag/--no-flag``); ``validate`` rejects inconsistent combinations before any model is loaded. The
resolved config is written to ``out_dir/config.json`` by the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trainer.advantages import BASELINES, SHAPING_MODES
from trainer.loss import AGGREGATIONS
from trainer.parallel import PARALLEL_MODES
from trainer.rollout_correction import LOGPROB_TEMPERATURES, ROLLOUT_CORRECTIONS

ADVANTAGE_MODES = ("sample", "rl", "opd", "combine", "prm_gated_opd", "multiplicative", "multiplicative_literal")


def _f(default: Any, help_text: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **kw})


@dataclass(frozen=True)
class TrainConfig:
    # --- where samples come from and where weights go
    model_path: str = _f("", "initial HF model folder (weights, config, tokenizer)")
    out_dir: str = _f("", "checkpoints, metrics.jsonl, config.json, tensorboard/")
    policy_url: str = _f("", "policy server base URL (lease/ack/weights update)")
    admin_api_key: str = _f("", "policy server admin bearer key")
    samples_file: str = _f("", "JSONL of samples to train on instead of a policy server (dev, DDP tests)")
    steps: int = _f(10, "total optimizer batches (counted across resumes)")
    batch_size: int = _f(8, "samples leased per step")
    min_batch: int = _f(0, "samples a step waits for (up to lease_wait_s, holding partial leases); 0 = batch_size")
    lease_wait_s: float = _f(30.0, "how long a step waits for min_batch samples before training on what it holds")
    idle_timeout_s: float = _f(0.0, "stop when no sample arrives for this long (0 = wait forever)")
    weight_sync: bool = _f(True, "POST /admin/weights/update after each checkpoint")
    sync_on_resume: bool = _f(True, "push the resumed checkpoint's weights to the engine at start")
    http_timeout_s: float = _f(30.0, "policy server call timeout (lease adds wait_s)")
    http_deadline_s: float = _f(120.0, "total retry budget per policy server call")
    weight_sync_timeout_s: float = _f(600.0, "timeout of one weights update call (pause+load+continue)")
    # --- optimisation
    lr: float = _f(1e-5, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.98, "AdamW beta2")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)")
    ppo_epochs: int = _f(1, "passes over each leased batch")
    minibatches: int = _f(1, "optimizer steps per pass (the batch is split)")
    micro_batch_size: int = _f(4, "samples per forward/backward (per rank)")
    clip_low: float = _f(0.2, "PPO clip epsilon below 1")
    clip_high: float = _f(0.28, "PPO clip epsilon above 1 (clip-higher)")
    aggregation: str = _f("token_mean", "loss aggregation over valid tokens", choices=AGGREGATIONS)
    kl_coef: float = _f(0.0, "k3 KL to the reference (initial) model; 0 loads no reference model")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    topk_coef: float = _f(0.0, "weight of the top-K reverse-KL distillation loss (needs teacher_topk)")
    # --- advantages
    advantage_mode: str = _f("sample", "'sample' follows each sample's mode field", choices=ADVANTAGE_MODES)
    old_logprobs: str = _f("recompute", "old log-probs for ratio and OPD: trainer recomputation or rollout (constrained samples "
                                        "always use the recomputation)", choices=("recompute", "rollout"))
    rollout_correction: str = _f("tis", "off-policy correction of the PPO term by w = exp(old - rollout) per token: none, tis "
                                        "(min(w, cap)) or mis (tokens with w > cap leave the loss); trainer/rollout_correction.py",
                                 choices=ROLLOUT_CORRECTIONS)
    rollout_is_cap: float = _f(2.0, "cap C of the rollout importance weight (tis truncates at C, mis rejects above C); >= 1")
    logprob_temperature: str = _f("one", "temperature of the PPO log-probs: one (T = 1; the IS weight absorbs the client's "
                                         "temperature) or sample (each sample's sampling_params.temperature)",
                                  choices=LOGPROB_TEMPERATURES)
    baseline: str = _f("running_mean", "RL baseline (docs/REWARD_MODES.md): running_mean (EMA of earlier rewards, per sample), "
                                       "window (mean of the last K), batch_mean, batch_mean_loo (leave-one-out) or none",
                       choices=BASELINES)
    running_mean_momentum: float = _f(0.9, "EMA momentum of the running_mean baseline (per sample)")
    baseline_window: int = _f(32, "K of the window baseline: the last K rewards")
    normalize_advantages: bool = _f(False, "divide RL advantages by their batch std (only with >= 2 rewards and std > eps; "
                                           "never by eps)")
    prm_config: str = _f("", "PRM YAML shared with the policy server: sets shaping, its parameters and mask_no_eos_with_zero "
                             "(trainer/prm.py)")
    shaping: str = _f("none", "AReaL shaping of token_rewards onto advantages", choices=("none", *SHAPING_MODES))
    shaping_negative_scale: float = _f(0.2, "gvpo negative_scale")
    shaping_zero_penalty: float = _f(0.4, "gvpo zero_penalty")
    shaping_eps: float = _f(1e-6, "gvpo zero band")
    gated_wrong_value: float = _f(-1.0, "prm_gated_opd advantage of the first wrong step")
    mask_no_eos_with_zero: bool = _f(False, "exclude responses that do not end with EOS (truncated)")
    # --- bookkeeping
    seed: int = _f(0, "torch seed")
    save_every: int = _f(1, "checkpoint (then ack + weight sync) every N steps; leases wait until then")
    keep_checkpoints: int = _f(3, "checkpoints kept on disk (older ones are deleted)")
    remember_sample_ids: int = _f(100_000, "recent trained sample ids kept to refuse re-leased duplicates")
    parallel: str = _f("ddp", "under torchrun: ddp (full replicas) or fsdp2 (fully_shard per decoder layer + root; full state "
                              "gathered on rank 0 for checkpoints); ignored with one process", choices=PARALLEL_MODES)
    check_ddp_sync: bool = _f(True, "ddp: all-gather a weight checksum each step and fail if ranks diverge (fsdp2 holds no replicas)")
    progress: bool = _f(True, "progress bar on stderr")

    def validate(self) -> None:
        if not self.model_path or not self.out_dir:
            raise ValueError("model_path and out_dir are required")
        if self.shaping == "process_weighted" and self.mask_no_eos_with_zero:
            raise ValueError("shaping process_weighted is incompatible with mask_no_eos_with_zero (AReaL contract)")
        for name in ("steps", "batch_size", "ppo_epochs", "minibatches", "micro_batch_size", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.min_batch <= self.batch_size:
            raise ValueError("min_batch must be in [0, batch_size] (0 = batch_size)")
        if self.batch_size < self.minibatches:
            raise ValueError("batch_size must be >= minibatches")
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "topk_coef", "lr", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.rollout_is_cap >= 1.0:  # a cap below 1 would alter exactly on-policy tokens (w = 1)
            raise ValueError("rollout_is_cap must be >= 1")
        if self.baseline_window < 1:
            raise ValueError("baseline_window must be >= 1")
        if not (0.0 <= self.running_mean_momentum < 1.0):
            raise ValueError("running_mean_momentum must be in [0, 1)")

    @property
    def min_batch_size(self) -> int:
        """The resolved ``--min-batch`` (0 stands for the batch size)."""
        return self.min_batch or self.batch_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["admin_api_key"]:
            d["admin_api_key"] = "***"  # the resolved config is written to disk and logs
        return d


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hindsight-train", description="Hindsight PPO trainer (see trainer/train.py).")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        p.add_argument(flag, type=type(f.default), **kw)
    return p


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(args))
    try:
        from trainer.prm import resolve_prm_config

        cfg = resolve_prm_config(cfg)
        cfg.validate()
    except ValueError as exc:
        build_parser().error(str(exc))
    return cfg
