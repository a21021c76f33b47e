"""Per-step metrics to stdout (one line), ``out_dir/metrics.jsonl`` and TensorBoard, on rank 0 only.

TensorBoard event files go to ``out_dir/tensorboard/`` through ``tensorboardX`` (a project dependency:
it writes the event format with protobuf alone, no TensorFlow or tensorboard install), every finite scalar
as ``train/<key>``; a background thread flushes them every ``TB_FLUSH_S`` seconds (and at close), so a
live ``tensorboard --logdir`` sees the curves grow during a run.
Other ranks get a null logger, so the loop always calls ``log`` without rank checks (nanochat's
DummyWandb pattern).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TB_FLUSH_S = 10


class MetricsLogger:
    def __init__(self, out_dir: str | Path, *, enabled: bool = True, to_stdout: bool = True):
        self.enabled = enabled
        self.to_stdout = to_stdout
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (open for the run; close() closes it)
        # Imported here: only rank 0 writes, and tensorboardX pulls in protobuf at import.
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(logdir=str(out / "tensorboard"), flush_secs=TB_FLUSH_S)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self.to_stdout:
            keys = (
                "loss",
                "reward_mean",
                "adv_abs_mean",
                "clip_frac",
                "approx_kl",
                "entropy",
                "train_rollout_lp_abs_diff",
                "n_tokens",
                "tokens_per_s",
                "forward_tokens_per_turn",
            )
            parts = [
                f"{k}={metrics[k]:.4g}" if isinstance(metrics.get(k), float) else f"{k}={metrics[k]}"
                for k in keys
                if k in metrics
            ]
            sys.stdout.write(f"step {step} " + " ".join(parts) + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
