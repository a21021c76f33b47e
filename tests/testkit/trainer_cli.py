"""``hindsight-train`` as a real process, alone or under torchrun (gloo on CPU), for the trainer's CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys

# One torch thread per process (the CI machine has 2 shared cores), offline, unbuffered logs.
TRAINER_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

# Small batches of 8 in micro-batches of 2, a large learning rate (a visible change in few steps), no progress
# bar and no weight push (no engine in these tests).
SMALL_BATCH_FLAGS = [
    "--batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-2",
    "--no-progress",
    "--no-weight-sync",
]


def run_trainer_cli(args: list[str], *, nproc: int = 0, timeout_s: float = 150) -> subprocess.CompletedProcess:
    """``python -m trainer.cli ARGS`` to completion; with ``nproc`` ranks under torchrun on this machine."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", f"--nproc-per-node={nproc}"]
        if nproc
        else [sys.executable]
    )
    cmd = [*launcher, "-m", "trainer.cli", *args]
    return subprocess.run(cmd, env=TRAINER_ENV, capture_output=True, text=True, timeout=timeout_s)
