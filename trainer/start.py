"""What a training run starts from: this process's place in the process group, the sample source the settings
name, and the policy (model, its DDP/FSDP2 wrapper, the optional frozen reference model, the optimizer).

Used by trainer.train's ``TrainingRun``; every function here runs once per run (``broadcast`` once per step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.chat import load_tokenizer
from trainer import parallel
from trainer.lease_client import FileSampleSource, PolicyClient, SampleSource
from trainer.settings import TrainConfig

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- compute init
def compute_init() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process; joins the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def broadcast(obj: Any, world: int) -> Any:
    """Rank 0's object on every rank (pickled over the process group)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def make_source(cfg: TrainConfig) -> SampleSource:
    """The sample source the settings name: a JSONL file, or the policy server's admin API."""
    if cfg.samples_file:
        return FileSampleSource(cfg.samples_file, Path(cfg.out_dir) / "file_source_state.json")
    if cfg.policy_url:
        return PolicyClient(
            cfg.policy_url,
            cfg.admin_api_key,
            timeout_s=cfg.http_timeout_s,
            deadline_s=cfg.http_deadline_s,
            weight_sync_timeout_s=cfg.weight_sync_timeout_s,
        )
    raise ValueError("one of policy_url or samples_file is required")


# ----------------------------------------------------------------------------- model load
@dataclass
class Policy:
    """The trained model, the module the loss runs through (DDP/FSDP2-wrapped), the frozen reference model
    (None when its KL coefficient is 0) and the optimizer."""

    model: torch.nn.Module
    wrapped: torch.nn.Module
    ref_model: torch.nn.Module | None
    opt: torch.optim.Optimizer
    eos_id: int | None


def load_policy(cfg: TrainConfig, ckpt: Path | None, device: torch.device, world: int) -> Policy:
    """The model from ``ckpt`` (or cfg.model_path on a fresh run), wrapped for cfg.parallel, and a fresh optimizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt or cfg.model_path), dtype=torch.float32).to(device)
    model.train()
    eos_id = load_tokenizer(cfg.model_path).eos_token_id
    ref_model = None
    if cfg.kl_coef > 0:  # never load (or run) a reference model whose term is multiplied by 0
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32).to(device).eval()
        ref_model.requires_grad_(False)
        ref_model = parallel.shard_frozen(ref_model, cfg.parallel, world)
    if cfg.parallel == "fsdp2" and world == 1:
        logger.info("--parallel fsdp2 with one process: nothing to shard, training the plain model")
    wrapped = parallel.wrap(model, cfg.parallel, world)  # before the optimizer: fsdp2 replaces parameters by shards
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    return Policy(model, wrapped, ref_model, opt, eos_id)


def reload_weights(policy: Policy, checkpoint: str | Path, world: int) -> None:
    """Every rank (a collective with more than one): replace the trained weights by ``checkpoint``'s (HF layout) and
    clear Adam's moments, which were accumulated along the path being abandoned (a rollback); the reference model is
    untouched. Only rank 0 reads the checkpoint into memory: with several ranks it broadcasts each tensor, which
    every DDP replica copies and every FSDP2 rank slices to its shard."""
    from transformers import AutoModelForCausalLM

    def read() -> dict[str, Any]:
        return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).state_dict()

    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(policy.model, read() if dist.get_rank() == 0 else {}, options=options)
    else:
        policy.model.load_state_dict(read())
    policy.opt.state.clear()
