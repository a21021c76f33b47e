"""``hindsight-train`` as a real process, alone or under torchrun (gloo on CPU), for the trainer's CLI tests."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.procs import child_env
from tests.testkit.procs import spawn

RUN_MODULE = Path(__file__).with_name("run_module.py").resolve()
# One torch thread per process: the CI machine has 2 shared cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def trainer_env(**extra: str) -> dict[str, str]:
    """A started process's environment (engine.procs.child_env: offline, unbuffered, no proxy) with
    :data:`ONE_THREAD`; ``extra`` on top."""
    return child_env({**ONE_THREAD, **extra})


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
    args: list[str],
    *,
    nproc: int = 0,
    timeout_s: float = 150,
    env: dict[str, str] | None = None,
    fork_ranks: bool = True,
) -> TrainerRun:
    """``python -m trainer.cli ARGS`` to completion; with ``nproc`` ranks under torchrun on this machine.

    Started by the test kit's ``spawn``, through its fork server when it qualifies (tests.testkit.forkserver: the
    trainer alone, or torchrun itself), which spares each run the 5-6 CPU-seconds a fresh interpreter spends
    importing torch and transformers. Under torchrun, ``fork_ranks`` has torchrun fork each rank from itself
    (its own ``--start-method fork`` over ``--run-path`` :data:`RUN_MODULE`, which runs ``-m trainer.cli`` in
    the rank), so the ranks start with those imports done too (measured: a 2-rank, 3-step run in 3 s instead
    of 9); ``fork_ranks=False`` starts them fresh with ``torchrun -m trainer.cli``, as launch/trainer.sh does.
    ``env`` is added to :func:`trainer_env`. Past ``timeout_s`` the run's process group is stopped (torchrun
    stops its ranks on SIGTERM; forked ranks are in its group) and TimeoutExpired raised."""
    if nproc:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
        ranks = ["--start-method", "fork", "--run-path", str(RUN_MODULE)] if fork_ranks else ["-m"]
        cmd = [*torchrun, f"--nproc-per-node={nproc}", *ranks, "trainer.cli", *args]
    else:
        cmd = [sys.executable, "-m", "trainer.cli", *args]
    with tempfile.TemporaryDirectory(prefix="hs-train-") as tmp:
        run = spawn("trainer", cmd, url="", log_dir=Path(tmp), env={**ONE_THREAD, **(env or {})})
        try:
            code = run.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            run.stop(grace_s=30)  # SIGTERM to its process group (torchrun stops its ranks), then SIGKILL
            raise
        return TrainerRun(code, run.log_path.read_text(errors="replace"))
