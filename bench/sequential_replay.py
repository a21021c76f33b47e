"""The canary test replayed over many simulated trials at once: engine.sequential.decide, vectorised.

Role: the one fast replay of the always-valid canary test, for the simulations that measure it: the defaults'
bench (bench/canary_defaults.py: uneven arms, a canary share of the traffic) and the test's guarantees checked
by simulation (tests/unit/test_sequential.py: arms in lockstep). A trial is a path of looks; at each look the
replay computes what :func:`engine.sequential.decide` computes from the arms' counts and sums (each arm's
interval at ``alpha / 2``, the interval of canary - live, the decision), for every trial and look in one numpy
pass. The radii are ``engine.sequential.radius`` itself (tabulated per ``n``), so the replay and the server
share the boundary; tests/unit/test_canary_defaults.py checks the decisions against ``decide`` look by look.

Input (:class:`Paths`): per trial and look, each arm's session count and reward sum so far; sums are integers
in units of ``1 / scale`` (a session's reward times ``scale`` is an integer), so a running sum is exact. An arm
gains at most one session per look (a look after every session, or after one session of each arm).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from engine.sequential import ArmStats, Decision, decide, radius

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

CONTINUE, PROMOTE, ROLLBACK = 0, 1, 2  # the decisions as :func:`first_decisions` codes them
DECISIONS = {CONTINUE: "continue", PROMOTE: "promote", ROLLBACK: "rollback"}


@dataclass(frozen=True)
class Rule:
    """The parameters of ``decide`` a replay runs under (``max_sessions`` off)."""

    alpha: float
    margin: float
    min_sessions: int
    rho: float

    def decide(self, canary: ArmStats, live: ArmStats) -> Decision:
        return decide(
            canary, live, alpha=self.alpha, margin=self.margin, min_sessions=self.min_sessions, rho=self.rho
        ).decision


@dataclass(frozen=True)
class Paths:
    """Running session counts and reward sums (times ``scale``) of each arm after each look, shape (trials, looks)."""

    canary_n: IntArray
    canary_sum: IntArray
    live_n: IntArray
    live_sum: IntArray
    scale: int = 1

    def arms(self, trial: int, look: int) -> tuple[ArmStats, ArmStats]:
        """The canary's and the live arm's stats at one look, as the server keeps them."""
        return (
            ArmStats(int(self.canary_n[trial, look]), float(self.canary_sum[trial, look]) / self.scale),
            ArmStats(int(self.live_n[trial, look]), float(self.live_sum[trial, look]) / self.scale),
        )


@lru_cache(maxsize=64)
def radii(max_n: int, alpha: float, rho: float) -> FloatArray:
    """``engine.sequential.radius(n, alpha, rho)`` for n = 0 .. max_n (inf at 0), read-only."""
    table = np.array([radius(n, alpha, rho) for n in range(max_n + 1)])
    table.flags.writeable = False  # shared by every caller through the cache
    return table


def _interval(n: IntArray, total: IntArray, scale: int, r: FloatArray) -> tuple[FloatArray, FloatArray]:
    mean = np.where(n > 0, total / (scale * np.maximum(n, 1)), 0.0)
    return np.maximum(-1.0, mean - r[n]), np.minimum(1.0, mean + r[n])


def diff_interval(paths: Paths, rule: Rule) -> tuple[FloatArray, FloatArray]:
    """The interval of canary - live at every look, (lo, hi) each (trials, looks): ``decide(...).diff``."""
    r = radii(paths.canary_n.shape[1], rule.alpha / 2, rule.rho)  # one table per trial length (cached): n <= looks
    c_lo, c_hi = _interval(paths.canary_n, paths.canary_sum, paths.scale, r)
    l_lo, l_hi = _interval(paths.live_n, paths.live_sum, paths.scale, r)
    return c_lo - l_hi, c_hi - l_lo


def first_decisions(paths: Paths, rule: Rule) -> tuple[IntArray, IntArray]:
    """Per trial: the decision (``CONTINUE``, ``PROMOTE``, ``ROLLBACK``) at its first look that is not
    ``continue``, and that look's index (the last look when undecided); ``decide``'s rule without
    ``max_sessions``."""
    lo, hi = diff_interval(paths, rule)
    rollback = hi < 0
    promote = (lo > -rule.margin) & (paths.canary_n >= rule.min_sessions)
    decided = rollback | promote
    at = np.argmax(decided, axis=1)
    rows = np.arange(len(at))
    kind = np.where(decided[rows, at], np.where(rollback[rows, at], ROLLBACK, PROMOTE), CONTINUE)
    return kind, np.where(kind != CONTINUE, at, decided.shape[1] - 1)


def check_against_decide(paths: Paths, rule: Rule, kind: IntArray, at: IntArray) -> None:
    """Raise RuntimeError unless ``decide`` agrees with :func:`first_decisions` (``kind``, ``at``, for the first
    ``len(kind)`` trials) at each decision and at the look before it."""
    for t in range(len(kind)):
        looks = [(int(at[t]), DECISIONS[int(kind[t])])] + ([(int(at[t]) - 1, "continue")] if at[t] > 0 else [])
        for i, expected in looks:
            got = rule.decide(*paths.arms(t, i))
            if got != expected:
                raise RuntimeError(f"trial {t} look {i}: decide says {got}, the replay {expected}")
