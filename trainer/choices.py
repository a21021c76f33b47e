"""The trainer's named options, in one torch-free place.

The settings (trainer/settings.py) validate flags against these before any model or torch is loaded, so a
bad command line fails in a fraction of a second; the modules that implement each option import their names
from here.
"""

from __future__ import annotations

BASELINES = ("running_mean", "window", "batch_mean", "batch_mean_loo", "none")
SHAPING_MODES = ("additive", "gvpo", "process_weighted")
AGGREGATIONS = ("token_mean", "seq_mean")
PARALLEL_MODES = ("ddp", "fsdp2")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
LOGPROB_TEMPERATURES = ("one", "sample")
