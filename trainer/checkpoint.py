"""Checkpoints under ``out_dir/step_XXXXXX``: a Hugging Face folder an engine can load, plus trainer state.

Layout of one checkpoint (written to ``.step_XXXXXX.tmp`` then renamed, so a crash never leaves a
half-written ``step_*`` that resume would pick):

    config.json, generation_config.json, model.safetensors   (save_pretrained, safetensors)
    tokenizer files, chat template ...                        (copied from the initial model folder)
    optimizer.pt                                              (AdamW state + its format + torch RNG)
    trainer_state.json                                        (step, leases to ack, recent sample ids, baseline)

Pruning keeps the newest ``keep`` checkpoints plus the ones the caller protects: the checkpoints the policy server
can restore (trainer/lineage.py ``restorable``: the live version's and a canary's on trial), which pushes deferred
behind a canary would otherwise push out of the newest ``keep`` while a rollback can still send the trainer and
the engines back to them.

``out_dir/ack_state.json`` records the last step whose leases were acked; a resume re-acks any lease of
the latest checkpoint above it (the crash fell between save and ack).

Under ``--parallel fsdp2`` the caller passes ``model_state`` / ``optim_state`` gathered on rank 0 by
``trainer.parallel.gather_for_checkpoint`` (full tensors on CPU); ``save_pretrained`` then writes them into the
same safetensors layout a DDP or single-process run produces, and optimizer.pt records ``format``
``fqn_full`` (parameter-name keyed) instead of ``torch`` (``Optimizer.state_dict()``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{6,})$")
# Files the checkpoint must not inherit from the initial folder: save_pretrained writes fresh ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_SKIP_NAMES = {"config.json", "generation_config.json", "model.safetensors.index.json", "trainer_state.json"}


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / f"step_{step:06d}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    out = Path(out_dir)
    if not out.is_dir():
        return None
    steps = [
        (int(m.group(1)), p)
        for p in out.iterdir()
        if (m := _STEP_RE.match(p.name)) and (p / "trainer_state.json").exists()
    ]
    return max(steps)[1] if steps else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    tokenizer_src: str | Path,
    state: dict[str, Any],
    *,
    keep: int = 3,
    protect: Iterable[str | Path] = (),
    model_state: dict[str, Any] | None = None,
    optim_state: dict[str, Any] | None = None,
    optim_format: str = "torch",
) -> Path:
    """Persist model + optimizer + state atomically, then prune; returns the final folder.

    ``protect``: checkpoint folders pruning never deletes (see :func:`prune_checkpoints`). ``model_state`` / ``optim_state`` replace the model's and optimizer's own state (FSDP2 full gathers).
    """
    out = Path(out_dir)
    final = step_dir(out, step)
    tmp = out / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if model_state is not None:
        model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    for f in Path(tokenizer_src).iterdir():
        if (
            f.is_file()
            and not f.name.endswith(_WEIGHT_SUFFIXES)
            and f.name not in _SKIP_NAMES
            and not (tmp / f.name).exists()
        ):
            shutil.copy2(f, tmp / f.name)
    torch.save(
        {
            "optimizer": optim_state if optim_state is not None else optimizer.state_dict(),
            "format": optim_format,
            "torch_rng": torch.get_rng_state(),
        },
        tmp / "optimizer.pt",
    )
    (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # a previous run saved this step but crashed before finishing: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(out)
    prune_checkpoints(out, keep, protect)
    return final


def prune_checkpoints(out_dir: Path, keep: int, protect: Iterable[str | Path] = ()) -> list[Path]:
    """Delete every ``step_*`` folder but the newest ``keep`` and those in ``protect`` (paths compared resolved;
    ones outside ``out_dir`` are ignored); returns the deleted folders, oldest first."""
    kept = {Path(p).resolve() for p in protect}
    steps = sorted((int(m.group(1)), p) for p in out_dir.iterdir() if (m := _STEP_RE.match(p.name)))
    doomed = [p for _, p in steps[:-keep] if p.resolve() not in kept]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "trainer_state.json").read_text())


def load_optimizer(
    ckpt: Path,
    optimizer: torch.optim.Optimizer,
    *,
    model: torch.nn.Module | None = None,
    parallel: str = "ddp",
    world: int = 1,
) -> None:
    """Restore optimizer state (in the format it was written, see trainer.parallel) and the torch RNG."""
    from trainer.parallel import load_optimizer_state

    blob = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    # Checkpoints written before the format key existed hold Optimizer.state_dict().
    load_optimizer_state(model, optimizer, blob["optimizer"], blob.get("format", "torch"), parallel, world)
    torch.set_rng_state(blob["torch_rng"])


def read_acked_step(out_dir: str | Path) -> int:
    p = Path(out_dir) / "ack_state.json"
    return int(json.loads(p.read_text())["acked_through_step"]) if p.exists() else 0


def write_acked_step(out_dir: str | Path, step: int) -> None:
    p = Path(out_dir) / "ack_state.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"acked_through_step": step}))
    os.replace(tmp, p)
