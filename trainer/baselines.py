"""RL baselines and the per-sample RL advantage r - b, as pure torch (no model, no I/O).

Live traffic gives small steps (often one sample) whose rewards are often all equal, so a baseline computed
from the step alone gives A = 0 to most of them. The default baseline is therefore a RUNNING one, kept
across steps and persisted in the checkpoint (:class:`RunningMean`).

Baselines (``--baseline``; b is computed from samples with a reward only, A = 0 for the others):

- ``running_mean`` (default): b = an EMA of EARLIER rewards, updated once per rewarded sample in batch order
  (v <- m v + (1 - m) r, momentum m = ``--running-mean-momentum``). Every sample of a step uses the value from
  before the step. The very first step, with no history, uses its own mean.
- ``window``: b = the mean of the last K earlier rewards (K = ``--baseline-window``), same timing.
- ``batch_mean``: b = the mean over the step's rewarded samples (a one-sample or equal-reward step gets A = 0).
- ``batch_mean_loo``: b_i = the mean of the OTHER rewarded samples of the step (a one-sample step gets A = 0).
- ``none``: b = 0.

Normalisation (``--normalize-advantages``): A / std, std being the population std of the step's advantages
over rewarded samples, applied only when at least two samples have a reward and std > eps; otherwise A is
left unscaled (never divided by eps: a zero std means there is no spread to normalise).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.choices import BASELINES

DEFAULT_WINDOW = 32


@dataclass
class RunningMean:
    """Running reward baseline over earlier samples: an EMA, or with ``window`` > 0 the mean of the last
    ``window`` rewards. ``count`` is how many rewards it has seen (0: no history yet)."""

    momentum: float = 0.9
    window: int = 0
    value: float = 0.0
    count: int = 0
    recent: list[float] = field(default_factory=list)

    def mean(self) -> float | None:
        """The baseline from the rewards seen so far; None without history."""
        if self.count == 0:
            return None
        return sum(self.recent) / len(self.recent) if self.window > 0 else self.value

    def update(self, rewards: Iterable[float]) -> None:
        """Fold rewards in, one sample at a time, in order."""
        for r in rewards:
            # The first reward initialises the EMA, so no fake prior of 0 biases the early baseline.
            self.value = r if self.count == 0 else self.momentum * self.value + (1 - self.momentum) * r
            self.count += 1
            if self.window > 0:
                self.recent = [*self.recent, r][-self.window :]

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "window": self.window,
            "value": self.value,
            "count": self.count,
            "recent": list(self.recent),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, *, momentum: float, window: int) -> RunningMean:
        """The persisted history under the CURRENT settings (momentum, window); older checkpoints carry no window."""
        state = state or {}
        recent = [float(x) for x in state.get("recent", [])]
        return cls(
            momentum=momentum,
            window=window,
            value=float(state.get("value", 0.0)),
            count=int(state.get("count", 0)),
            recent=recent[-window:] if window > 0 else recent,
        )


def rl_sample_advantages(
    rewards: torch.Tensor,  # (B,) float; ignored where has_reward is False
    has_reward: torch.Tensor,  # (B,) bool
    *,
    baseline: str = "none",
    normalize: bool = False,
    running: RunningMean | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:  # (B,) float, 0 where has_reward is False
    """Per-sample RL advantage r - b (optionally / std). Computed on the WHOLE batch (all DDP ranks agree).

    ``running`` is the state of ``running_mean`` / ``window`` (updated here, after use); None starts a fresh
    one. It must have been built for the same kind (``window`` > 0 exactly for ``window``)."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    has = has_reward.bool()
    r = torch.where(has, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    n = int(has.sum())
    if n == 0:
        return torch.zeros_like(r)
    total = float(r.sum())
    if baseline == "batch_mean":
        b: torch.Tensor | float = total / n
    elif baseline == "batch_mean_loo":
        # Leave-one-out: each sample's baseline excludes itself; alone in the step it has no one to compare with.
        b = (total - r) / (n - 1) if n > 1 else r
    elif baseline in ("running_mean", "window"):
        running = running if running is not None else RunningMean(window=DEFAULT_WINDOW if baseline == "window" else 0)
        if (running.window > 0) != (baseline == "window"):
            raise ValueError(
                f"baseline {baseline!r} needs a RunningMean with window {'> 0' if baseline == 'window' else '0'}"
            )
        prior = running.mean()
        b = total / n if prior is None else prior
        running.update(float(x) for x in r[has].tolist())
    else:
        b = 0.0
    adv = torch.where(has, r - b, torch.zeros_like(r))
    if normalize and n > 1:
        std = float((adv[has].pow(2).sum() / n - (adv[has].sum() / n) ** 2).clamp(min=0).sqrt())
        if math.isfinite(std) and std > eps:
            adv = adv / std
    return adv
