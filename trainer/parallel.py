"""Data parallelism for the trainer: DDP replicas or FSDP2 shards, behind the few calls the loop needs.

Role: ``train.py`` stays one top-down loop; this module owns what differs between ``--parallel ddp`` and
``--parallel fsdp2`` (runs under torchrun: DDP replicas, or FSDP2 shards where the model is large).

Contract:
- ``wrap``: with one process both settings return the model unchanged (no process group, nothing to
  shard). ``ddp`` wraps it in ``DistributedDataParallel`` (full replicas; the loop's weight-checksum
  check applies). ``fsdp2`` calls ``torch.distributed.fsdp.fully_shard`` on every decoder layer (the
  classes named by ``model._no_split_modules``, else ``model.model.layers``) and then on the root, in
  place; parameters become DTensor shards, so the optimizer must be built after ``wrap``. The forward
  module is the model itself. Gradients are averaged over ranks in both settings (DDP all-reduce, FSDP2
  reduce-scatter), so the loop's ``loss * world`` scaling is the same.
- ``grad_sync``: DDP ``no_sync()`` / FSDP2 ``set_requires_gradient_sync(False)`` on all but the last
  micro-batch of an optimizer step (gradient accumulation without per-micro-batch communication).
- ``grad_norm``: the pre-clip global norm as a float (FSDP2's ``clip_grad_norm_`` returns a DTensor).
- ``gather_for_checkpoint`` is COLLECTIVE under fsdp2 (every rank must call it): it returns on rank 0 the
  full, CPU-offloaded model state dict (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``,
  minus tied duplicates such as ``lm_head.weight``, so ``save_pretrained`` writes the same safetensors
  layout as DDP) and the full optimizer state keyed by parameter name; ``{}`` on other ranks. Under ddp
  it returns ``(None, None)``: rank 0 saves its replica directly.
- ``load_optimizer_state``: optimizer.pt records its ``format`` (``torch`` = ``Optimizer.state_dict()``,
  ``fqn_full`` = the gathered FSDP2 form). Each format is loaded only under the setting that wrote it;
  a mismatch is a ``ValueError`` naming both, never a silently reset optimizer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, cast

import torch

from trainer.choices import PARALLEL_MODES

logger = logging.getLogger(__name__)

OPT_FORMATS = {"ddp": "torch", "fsdp2": "fqn_full"}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks that become one FSDP2 unit each."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        inner = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []))
    if not layers:
        raise ValueError(
            f"fsdp2: no decoder layers found in {type(model).__name__} (no _no_split_modules, no model.layers)"
        )
    return layers


def wrap(model: torch.nn.Module, parallel: str, world: int) -> torch.nn.Module:
    """The module to call for training forwards (see the module docstring)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if world == 1:
        return model
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)  # the root unit holds embeddings, final norm and the (tied) head
    logger.info("fsdp2: sharded %d decoder layers + root over %d ranks", len(layers), world)
    return model


def shard_frozen(model: torch.nn.Module, parallel: str, world: int) -> torch.nn.Module:
    """A no-grad model (the KL reference) under the same setting: sharded under fsdp2, replicated otherwise."""
    if parallel == "fsdp2" and world > 1:
        return wrap(model, parallel, world)
    return model


@contextlib.contextmanager
def grad_sync(net: torch.nn.Module, parallel: str, world: int, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter unless ``enabled`` (the last micro-batch)."""
    if world == 1 or enabled:
        yield
        return
    if parallel == "ddp":
        with cast(torch.nn.parallel.DistributedDataParallel, net).no_sync():  # wrap() made it one
            yield
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = cast(FSDPModule, net)  # fully_shard() turned the root module into one
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


def grad_norm(total_norm: torch.Tensor) -> float:
    full = getattr(total_norm, "full_tensor", None)  # DTensor under fsdp2
    return float(full() if full is not None else total_norm)


def gather_for_checkpoint(
    model: torch.nn.Module, opt: torch.optim.Optimizer, parallel: str, world: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(model_state, optim_state) for rank 0's ``save_checkpoint``; collective under fsdp2."""
    if parallel != "fsdp2" or world == 1:
        return None, None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict):
        for target, source in tied.items():
            if target in msd and source in msd:  # save_pretrained keeps one copy of a tied pair
                del msd[target]
    return msd, osd


def optimizer_format(parallel: str, world: int) -> str:
    return OPT_FORMATS["fsdp2"] if parallel == "fsdp2" and world > 1 else OPT_FORMATS["ddp"]


def load_optimizer_state(
    model: torch.nn.Module | None,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    fmt: str,
    parallel: str,
    world: int,
) -> None:
    """Restore optimizer.pt's state written in ``fmt`` (see the module docstring)."""
    want = optimizer_format(parallel, world)
    if fmt != want:
        raise ValueError(
            f"checkpoint optimizer state has format {fmt!r} but --parallel {parallel} with {world} process(es) "
            f"needs {want!r}; resume with the setting that wrote it"
        )
    if fmt == "torch":
        opt.load_state_dict(state)
        return
    if model is None:
        raise ValueError(f"restoring optimizer state in format {fmt!r} needs the sharded model")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def weight_checksum_spread(model: torch.nn.Module, world: int) -> float:
    """Max difference of a float64 weight checksum across ranks (0.0 when the replicas are identical)."""
    with torch.no_grad():
        zero = torch.zeros((), dtype=torch.float64)  # a tensor start keeps sum() typed as a tensor
        c = torch.stack(
            [
                sum((p.double().sum() for p in model.parameters()), zero),
                sum((p.double().abs().sum() for p in model.parameters()), zero),
            ]
        )
    if world == 1:
        return 0.0
    allc = [torch.zeros_like(c) for _ in range(world)]
    torch.distributed.all_gather(allc, c)
    stacked = torch.stack(allc)
    return float((stacked.max(0).values - stacked.min(0).values).max())
