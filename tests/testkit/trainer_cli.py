"""``hindsight-train`` as a real process, alone or under torchrun (gloo on CPU), for the trainer's CLI tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.procs import child_env
from tests.testkit import forkserver


def trainer_env(**extra: str) -> dict[str, str]:
    """A started process's environment (engine.procs.child_env: offline, unbuffered, no proxy) with one torch
    thread per process (the CI machine has 2 shared cores); ``extra`` on top."""
    return child_env({"OMP_NUM_THREADS": "1", **extra})


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


@dataclass(frozen=True)
class TrainerRun:
    """A finished trainer command: its exit status and its output (stdout and stderr together, as logged)."""

    returncode: int
    output: str


def run_trainer_cli(
    args: list[str], *, nproc: int = 0, timeout_s: float = 150, env: dict[str, str] | None = None
) -> TrainerRun:
    """``python -m trainer.cli ARGS`` to completion; with ``nproc`` ranks under torchrun on this machine.

    Started through the test kit's fork server when it qualifies (tests.testkit.forkserver: the trainer alone,
    or torchrun itself, whose ranks it starts fresh), which spares each run the 5-6 CPU-seconds a fresh
    interpreter spends importing torch and transformers. ``env`` is added to :func:`trainer_env`. Past
    ``timeout_s`` the run's process group is stopped (torchrun stops its ranks on SIGTERM) and TimeoutExpired
    raised."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", f"--nproc-per-node={nproc}"]
        if nproc
        else [sys.executable]
    )
    cmd = [*launcher, "-m", "trainer.cli", *args]
    with tempfile.TemporaryDirectory(prefix="hs-train-") as tmp:
        log = Path(tmp) / "trainer.log"
        proc = forkserver.launch(cmd, log_path=log, env=trainer_env(**(env or {})))
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                    os.killpg(proc.pid, sig)  # the run leads its own process group
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
                    break
            raise
        return TrainerRun(code, log.read_text(errors="replace"))
