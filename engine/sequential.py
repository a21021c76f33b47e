"""The always-valid comparison of a canary weight version against the live one, on per-session rewards.

Role: decide, after every judged session, whether a new version is worse than the live one (roll back),
not worse (promote), or not known yet (keep testing), with error rates that hold however often it looks.

Data: one reward per session (the unit that is independent across users; the turns of one session are not),
in [-1, 1]: the mean of the session's main-turn judge verdicts and explicit feedback values
(policy_server.store.version_rewards). Each arm keeps only its count and sum (:class:`ArmStats`).

Record: :func:`decide` answers a :class:`Comparison` (each arm's sessions, mean and interval, the interval of
canary - live, the decision), the same record ``GET /admin/weights`` answers as its ``comparison``.

Test: a confidence sequence for each arm's mean from Robbins' normal mixture (Howard, Ramdas, McAuliffe and
Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic confidence sequences", eq. (14)): a reward in
[-1, 1] is 1-sub-Gaussian around its mean, so with S_n the centred sum and V_n = n,

    P( exists n >= 1 : |S_n| >= sqrt((V_n + rho) * (log((V_n + rho) / rho) + 2 log(1 / a))) ) <= a

(Ville's inequality on the mixture supermartingale). Each arm gets a = alpha / 2, so with probability at
least 1 - alpha BOTH sequences cover their means at every n simultaneously, and then
[lo_canary - hi_live, hi_canary - lo_live] covers the difference d = mean_canary - mean_live at every
moment, whatever the arms' sample sizes and however they grew.

Decisions (:func:`decide`), from that interval:

- ``rollback`` when its upper end is below 0 (the canary is worse): if d >= 0, this happens at ANY time with
  probability at most alpha (the false-alarm guarantee, tested by simulation in tests/unit);
- ``promote`` when its lower end is above ``-margin`` and the canary has ``min_sessions``: if d <= -margin,
  this happens with probability at most alpha;
- ``continue`` otherwise; ``max_sessions`` (if set) ends the trial as ``rollback`` (an undecided canary is
  not shown to be safe: the cautious default), which only ever adds rollbacks.

``rho`` tunes where the boundary is tightest; :func:`rho_for` picks it for an expected trial length and
:func:`trial_rho` is the choice the server makes. The default parameters (``DEFAULT_*``, the server's
``--canary-*`` defaults) were chosen by bench/canary_defaults.py (figures in docs/SAFE_UPDATES.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from engine.records import Interval

Decision = Literal["continue", "promote", "rollback"]
REWARD_LO, REWARD_HI = -1.0, 1.0
DEFAULT_ALPHA = 0.05
DEFAULT_MARGIN = 0.2
DEFAULT_MIN_SESSIONS = 20
TIGHTEST_AT_SESSIONS = 50  # per arm: where the boundary is tightest unless min_sessions is larger
SIGMA = (REWARD_HI - REWARD_LO) / 2  # Hoeffding: a variable in [lo, hi] is (hi - lo) / 2 sub-Gaussian


@dataclass(frozen=True)
class ArmStats:
    """One arm's sessions: their count and the sum of their rewards (each clipped to [-1, 1])."""

    n: int = 0
    total: float = 0.0

    def add(self, reward: float) -> ArmStats:
        return ArmStats(self.n + 1, self.total + min(REWARD_HI, max(REWARD_LO, reward)))

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0


class Arm(BaseModel):
    """One arm now: its judged sessions, their mean reward and the always-valid interval of its mean."""

    model_config = ConfigDict(frozen=True, strict=True)

    sessions: int
    mean: float
    interval: Interval


class Comparison(BaseModel):
    """The state of a trial: each arm, the interval for canary minus live, and the decision."""

    model_config = ConfigDict(frozen=True, strict=True)

    canary: Arm
    live: Arm
    diff: Interval
    decision: Decision


def radius(n: int, alpha: float, rho: float) -> float:
    """Half-width of the time-uniform (level ``1 - alpha``) confidence sequence for a mean of ``n`` rewards in
    [-1, 1] (infinite at n = 0)."""
    if n <= 0:
        return math.inf
    v = SIGMA * SIGMA * n
    return math.sqrt((v + rho) * (math.log((v + rho) / rho) + 2 * math.log(1 / alpha))) / n


def interval(arm: ArmStats, alpha: float, rho: float) -> Interval:
    r = radius(arm.n, alpha, rho)
    return Interval(lo=max(REWARD_LO, arm.mean - r), hi=min(REWARD_HI, arm.mean + r))


def rho_for(n_sessions: int, alpha: float) -> float:
    """The mixture parameter that makes the boundary tightest at ``n_sessions`` (a search over a log grid: the
    radius is smooth and unimodal in rho)."""
    grid = [10 ** (k / 20) for k in range(-40, 81)]  # 0.01 .. 10_000
    return min(grid, key=lambda rho: radius(n_sessions, alpha, rho))


def trial_rho(alpha: float, min_sessions: int) -> float:
    """The mixture parameter of a trial at level ``alpha`` (each arm ``alpha / 2``): the boundary is tightest at
    ``TIGHTEST_AT_SESSIONS`` sessions per arm, or at ``min_sessions`` when a promotion needs more."""
    return rho_for(max(min_sessions, TIGHTEST_AT_SESSIONS), alpha / 2)


def decide(
    canary: ArmStats,
    live: ArmStats,
    *,
    alpha: float,
    margin: float,
    min_sessions: int,
    max_sessions: int | None = None,
    rho: float,
) -> Comparison:
    """Compare the arms now (see the module docstring for the rule and its guarantees)."""
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    ci = interval(canary, alpha / 2, rho)
    li = interval(live, alpha / 2, rho)
    diff = Interval(lo=ci.lo - li.hi, hi=ci.hi - li.lo)
    decision: Decision = "continue"
    if diff.hi < 0:
        decision = "rollback"
    elif diff.lo > -margin and canary.n >= min_sessions:
        decision = "promote"
    elif max_sessions is not None and canary.n >= max_sessions:
        decision = "rollback"
    return Comparison(
        canary=Arm(sessions=canary.n, mean=canary.mean, interval=ci),
        live=Arm(sessions=live.n, mean=live.mean, interval=li),
        diff=diff,
        decision=decision,
    )
