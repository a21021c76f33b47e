"""The trainer's one configuration object: every default defined once, the command line generated from it.

``TrainConfig`` is a frozen pydantic-settings class (env prefix ``HINDSIGHT_TRAIN_``); engine.cli_settings
turns it into ``hindsight-train``'s flags (``--batch-size`` for ``batch_size``; booleans take ``--flag``,
``--flag false`` or ``--no-flag``), with a ``--config`` file below the environment and the flags. The
policy server's admin key is never a flag: ``HINDSIGHT_TRAIN_ADMIN_API_KEY``, ``--admin-api-key-file`` or
the config file. ``validate`` rejects inconsistent combinations before any model is loaded. The resolved
config (key redacted) is written to ``out_dir/config.json`` by the loop.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from engine.cli_settings import CliSettings, EnvOnly, OneOf
from trainer.choices import (
    AGGREGATIONS,
    BASELINES,
    LOGPROB_TEMPERATURES,
    PARALLEL_MODES,
    ROLLOUT_CORRECTIONS,
    SHAPING_MODES,
)

PROG = "hindsight-train"
DESCRIPTION = "Hindsight PPO trainer: lease samples from the policy server, update, checkpoint, sync weights."
ADVANTAGE_MODES = ("sample", "rl", "opd", "combine", "prm_gated_opd", "multiplicative", "multiplicative_literal")
UNBOUNDED_STEPS = sys.maxsize  # what ``--steps 0`` (until stopped) resolves to


class TrainConfig(CliSettings):
    """Resolved trainer configuration (frozen); names carry units (``_s``)."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_TRAIN_", extra="ignore", frozen=True)

    # --- where samples come from and where weights go
    model_path: str = Field("", description="initial HF model folder (weights, config, tokenizer)")
    out_dir: str = Field("", description="checkpoints, metrics.jsonl, config.json, tensorboard/")
    policy_url: str = Field("", description="policy server base URL (lease/ack/weights update)")
    # A key on argv is readable by every local user (ps, /proc): the environment or a file only.
    admin_api_key: Annotated[str, EnvOnly()] = Field(
        "", description="policy server admin bearer key (environment or config file only, never a flag)"
    )
    admin_api_key_file: str = Field(
        "", description="file holding the policy server admin bearer key (wins over HINDSIGHT_TRAIN_ADMIN_API_KEY)"
    )
    samples_file: str = Field(
        "", description="JSONL of samples to train on instead of a policy server (dev, DDP tests)"
    )
    steps: int = Field(
        10, ge=0, description="total optimizer batches (counted across resumes); 0 = until stopped (or idle_timeout_s)"
    )
    batch_size: int = Field(8, description="samples leased per step")
    # Defaults of min_batch, ppo_epochs, minibatches, baseline and max_staleness: the live closed loop's winners
    # (bench/online_trickle.py --closed-loop; table in docs/REWARD_MODES.md "Defaults, measured").
    min_batch: int = Field(
        4,
        description="samples a step waits for (up to lease_wait_s, holding partial leases); 0 = batch_size; "
        "the default is capped at batch_size",
    )
    lease_wait_s: float = Field(
        30.0, description="how long a step waits for min_batch samples before training on what it holds"
    )
    max_staleness: int = Field(
        4,
        description="set aside samples generated more than K weight versions (trainer steps) before the weights "
        "being updated (-1 = no bound; a samples file has none)",
    )
    idle_timeout_s: float = Field(0.0, description="stop when no sample arrives for this long (0 = wait forever)")
    weight_sync: bool = Field(True, description="POST /admin/weights/update after each checkpoint")
    sync_on_resume: bool = Field(True, description="push the resumed checkpoint's weights to the engine at start")
    http_timeout_s: float = Field(30.0, description="policy server call timeout (lease adds wait_s)")
    http_deadline_s: float = Field(120.0, description="total retry budget per policy server call")
    weight_sync_timeout_s: float = Field(600.0, description="timeout of one weights update call (pause+load+continue)")
    # --- optimisation
    lr: float = Field(1e-5, description="AdamW learning rate")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, description="AdamW beta1")
    adam_beta2: float = Field(0.98, description="AdamW beta2")
    max_grad_norm: float = Field(1.0, description="gradient clipping norm (0 = off)")
    ppo_epochs: int = Field(2, description="passes over each leased batch (from the 2nd on, PPO clipping acts)")
    minibatches: int = Field(1, description="optimizer steps per pass (the batch is split)")
    micro_batch_size: int = Field(4, description="samples per forward/backward (per rank)")
    merge_trajectories: bool = Field(
        True,
        description="run a session's token-continuous turns as one sequence (its prompt once; same per-token "
        "loss to float rounding); merges turns that land in the same micro-batch, so keep --minibatches 1; "
        "--no-merge-trajectories runs every turn as its own row",
    )
    clip_low: float = Field(0.2, description="PPO clip epsilon below 1")
    clip_high: float = Field(0.28, description="PPO clip epsilon above 1 (clip-higher)")
    aggregation: Annotated[str, OneOf(AGGREGATIONS)] = Field(
        "token_mean", description="loss aggregation over valid tokens"
    )
    kl_coef: float = Field(0.0, description="k3 KL to the reference (initial) model; 0 loads no reference model")
    entropy_coef: float = Field(0.0, description="entropy bonus coefficient")
    topk_coef: float = Field(0.0, description="weight of the top-K reverse-KL distillation loss (needs teacher_topk)")
    # --- advantages
    advantage_mode: Annotated[str, OneOf(ADVANTAGE_MODES)] = Field(
        "sample", description="'sample' follows each sample's mode field"
    )
    old_logprobs: Annotated[str, OneOf(("recompute", "rollout"))] = Field(
        "recompute",
        description="old log-probs for ratio and OPD: trainer recomputation or rollout (constrained "
        "samples always use the recomputation)",
    )
    old_logprob_pass: Annotated[str, OneOf(("auto", "separate"))] = Field(
        "auto",
        description="auto: an on-policy step (1 PPO epoch, 1 minibatch, 1 micro-batch per rank, no dropout) reads "
        "the old log-probs from the update's own forward, one forward fewer (trainer/old_pass.py); separate: "
        "always a no-grad pass first",
    )
    rollout_correction: Annotated[str, OneOf(ROLLOUT_CORRECTIONS)] = Field(
        "tis",
        description="off-policy correction of the PPO term by w = exp(old - rollout) per token: none, tis "
        "(min(w, cap)) or mis (tokens with w > cap leave the loss); trainer/rollout_correction.py",
    )
    rollout_is_cap: float = Field(
        2.0, description="cap C of the rollout importance weight (tis truncates at C, mis rejects above C); >= 1"
    )
    logprob_temperature: Annotated[str, OneOf(LOGPROB_TEMPERATURES)] = Field(
        "one",
        description="temperature of the PPO log-probs: one (T = 1; the IS weight absorbs the client's "
        "temperature) or sample (each sample's sampling_params.temperature)",
    )
    baseline: Annotated[str, OneOf(BASELINES)] = Field(
        "running_mean",
        description="RL baseline "
        "(docs/REWARD_MODES.md): running_mean (EMA of earlier rewards, "
        "per sample), window (mean of the last K), batch_mean, "
        "batch_mean_loo (leave-one-out) or none",
    )
    running_mean_momentum: float = Field(0.9, description="EMA momentum of the running_mean baseline (per sample)")
    baseline_window: int = Field(32, description="K of the window baseline: the last K rewards")
    normalize_advantages: bool = Field(
        False,
        description="divide RL advantages by their batch std (only with >= 2 rewards and std > eps; never by eps)",
    )
    prm_config: str = Field(
        "",
        description="PRM YAML shared with the policy server: sets shaping, its parameters and "
        "mask_no_eos_with_zero (trainer/prm.py)",
    )
    shaping: Annotated[str, OneOf(("none", *SHAPING_MODES))] = Field(
        "none", description="AReaL shaping of token_rewards onto advantages"
    )
    shaping_negative_scale: float = Field(0.2, description="gvpo negative_scale")
    shaping_zero_penalty: float = Field(0.4, description="gvpo zero_penalty")
    shaping_eps: float = Field(1e-6, description="gvpo zero band")
    gated_wrong_value: float = Field(-1.0, description="prm_gated_opd advantage of the first wrong step")
    mask_no_eos_with_zero: bool = Field(False, description="exclude responses that do not end with EOS (truncated)")
    # --- bookkeeping
    seed: int = Field(0, description="torch seed")
    save_every: int = Field(1, description="checkpoint (then ack + weight sync) every N steps; leases wait until then")
    keep_checkpoints: int = Field(
        3,
        description="newest checkpoints kept on disk; older ones are deleted, except the live version's and a "
        "canary's on trial (a rollback restores them)",
    )
    remember_sample_ids: int = Field(
        100_000, description="recent trained sample ids kept to refuse re-leased duplicates"
    )
    parallel: Annotated[str, OneOf(PARALLEL_MODES)] = Field(
        "ddp",
        description="under torchrun: ddp (full replicas) or "
        "fsdp2 (fully_shard per decoder layer + root; full state "
        "gathered on rank 0 for checkpoints); ignored with one "
        "process",
    )
    check_ddp_sync: bool = Field(
        True,
        description="ddp: all-gather a weight checksum each step and fail if ranks diverge (fsdp2 holds no replicas)",
    )
    progress: bool = Field(True, description="progress bar on stderr")

    def check_consistency(self) -> None:
        if not self.model_path or not self.out_dir:
            raise ValueError("model_path and out_dir are required")
        if self.shaping == "process_weighted" and self.mask_no_eos_with_zero:
            raise ValueError("shaping process_weighted is incompatible with mask_no_eos_with_zero (AReaL contract)")
        for name in (
            "steps",
            "batch_size",
            "ppo_epochs",
            "minibatches",
            "micro_batch_size",
            "save_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_staleness < -1:
            raise ValueError("max_staleness must be >= 0, or -1 for no bound")
        if self.min_batch < 0 or ("min_batch" in self.model_fields_set and self.min_batch > self.batch_size):
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
        """The resolved ``--min-batch`` (0 stands for the batch size; the default is capped at it)."""
        return min(self.min_batch or self.batch_size, self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump()
        if d["admin_api_key"]:
            d["admin_api_key"] = "***"  # the resolved config is written to disk and logs
        return d

    @field_validator("steps")
    @classmethod
    def _unbounded_steps(cls, v: int) -> int:
        # The loop counts up to ``steps``: "until stopped" is a bound it never reaches.
        return UNBOUNDED_STEPS if v == 0 else v

    @model_validator(mode="before")
    @classmethod
    def _read_key_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("admin_api_key_file"):
            path = Path(str(data["admin_api_key_file"]))
            try:
                data = {**data, "admin_api_key": path.read_text(encoding="utf-8").strip()}
            except OSError as exc:
                raise ValueError(f"admin_api_key_file {path}: {exc.strerror or exc}") from None
        return data
