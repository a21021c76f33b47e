"""Bench: the canary test's defaults (alpha, margin, min sessions, canary share) chosen by simulation.

Run:  python -m bench.canary_defaults [--trials 300] [--horizon 8000] [--max-harmed 500] [--seed 0]

Role: measure, for every setting of a grid, what the always-valid canary test (engine.sequential.decide) does
with live traffic, and pick the defaults of policy_server.settings by the rule below. Seeded: the same
arguments print the same figures (tables on stdout, progress on stderr); about 50 s of CPU (3 min wall on a
busy 2-core box).

Traffic (two engines, ``--canary-share``): each new session goes to the canary with probability ``share``,
else to the live version; the test looks after every session (at least as often as the server, which looks
every ``--canary-check-interval-s``) and compares the canary's sessions with the live sessions since the
canary started. A session's reward is the mean of its judge verdicts, 1 to 4 of them (uniform), each +1 or
-1: values in [-1, 1]. The live version's mean reward is 0.2, the canary's 0.2 + d. A trial ends at the
first decision, or undecided after ``horizon`` sessions of traffic.

Figures per setting and true difference d: P(rollback), P(promote), P(undecided), and the median and p90 of
the canary sessions to a decision (the users the canary served) and of all sessions of traffic to a decision
(how long the trial lasts: about canary sessions / share); an undecided trial counts as ``never``. The test is
replayed by bench.sequential_replay (decide, vectorised); each of its decisions is checked against
engine.sequential.decide (at the decision and the look before it) for the first trials of every cell: the bench
stops if they disagree.

The rule (:func:`apply_rule`, :func:`choose`), in order:

1. The promise holds: a canary that is not worse is rolled back, and one worse by 0.2 (a tenth of the reward
   range) or more promoted, in at most 5% of trials, guaranteed whatever the rewards (``alpha`` <= 0.05,
   ``margin`` <= 0.2; ``--canary-max-sessions`` stays off, as a cap only adds rollbacks of undecided
   canaries) and measured (P(rollback) <= alpha at d >= 0, P(promote) <= alpha at d <= -margin).
2. Few users get a harmful update: d <= -0.3 is rolled back in at least 90% of trials, within ``max_harmed``
   (500) canary sessions at p90.
3. A helpful update ships: d = +0.1 is promoted in at least 90% of trials within the horizon.
4. Of the settings left, the one that serves a harmful update for the shortest time: the fewest sessions of
   traffic until d = -0.3 is rolled back (p90); then the shortest trial of a helpful update (sessions of
   traffic until d = +0.1 is promoted, median); ties within 2% keep the most current default values.

Steps 2 and 4 pull the share apart: a smaller share exposes fewer users to a harmful version (the live arm,
larger, is known better) but keeps it on trial longer; ``--max-harmed`` is the tolerance that settles it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from bench.sequential_replay import (
    CONTINUE,
    PROMOTE,
    ROLLBACK,
    FloatArray,
    IntArray,
    Paths,
    Rule,
    check_against_decide,
    first_decisions,
)
from engine.sequential import trial_rho
from policy_server.settings import PolicySettings

LIVE_MEAN = 0.2
VERDICTS = (1, 4)  # judge verdicts per session: uniform in [lo, hi]
SCALE = 12  # lcm(1..4): a session's reward times SCALE is an integer, so the running sums are exact
DIFFS = (-0.5, -0.3, -0.2, -0.1, 0.0, 0.1)
ALPHAS = (0.01, 0.05, 0.1)
MARGINS = (0.1, 0.2, 0.3)
MIN_SESSIONS = (10, 20, 50)
SHARES = (0.05, 0.1, 0.2, 0.3, 0.5)
TRIAL_CHUNK = 50  # trials simulated at once (memory: a few arrays of chunk x sessions)

# The rule's limits (module docstring).
MAX_ERROR = 0.05  # alpha at most
WORSE_BY = 0.2
HARMFUL = -0.3
HELPFUL = 0.1
MAX_HARMED = 500  # canary sessions a harmful update may serve, p90 (step 2)
TIE = 0.02


@dataclass(frozen=True)
class Setting:
    alpha: float
    margin: float
    min_sessions: int
    share: float

    @property
    def rho(self) -> float:
        return trial_rho(self.alpha, self.min_sessions)

    @property
    def rule(self) -> Rule:
        """The test's parameters under this setting (the share is the traffic's)."""
        return Rule(self.alpha, self.margin, self.min_sessions, self.rho)


@dataclass(frozen=True)
class Outcome:
    """One setting at one true difference ``d``, over ``trials`` seeded trials."""

    setting: Setting
    d: float
    trials: int
    p_rollback: float
    p_promote: float
    canary_p50: float  # canary sessions to a decision (inf: undecided within the horizon)
    canary_p90: float
    total_p50: float  # sessions of traffic (canary and live) to a decision
    total_p90: float

    @property
    def p_undecided(self) -> float:
        return 1.0 - self.p_rollback - self.p_promote


def simulate_paths(share: float, d: float, trials: int, sessions: int, rng: np.random.Generator) -> Paths:
    """``trials`` trials of ``sessions`` sessions of traffic (module docstring), a look after each session."""
    to_canary = rng.random((trials, sessions)) < share
    mean = np.where(to_canary, LIVE_MEAN + d, LIVE_MEAN)
    k = rng.integers(VERDICTS[0], VERDICTS[1] + 1, size=(trials, sessions))
    plus = rng.binomial(k, (1 + mean) / 2)
    scaled = (2 * plus - k) * (SCALE // k)  # SCALE * (plus - minus) / k, exact
    c = to_canary.astype(np.int64)
    return Paths(
        np.cumsum(c, axis=1),
        np.cumsum(scaled * c, axis=1),
        np.cumsum(1 - c, axis=1),
        np.cumsum(scaled * (1 - c), axis=1),
        SCALE,
    )


def _quantile(values: FloatArray, q: float) -> float:
    """The empirical q-quantile (an element, so an undecided trial's inf stays inf)."""
    ordered = np.sort(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)]) if len(ordered) else math.inf


def measure(
    settings: Sequence[Setting], diffs: Sequence[float], *, trials: int, horizon: int, seed: int
) -> list[Outcome]:
    """Every setting at every true difference over ``horizon`` sessions of traffic, on common random numbers: for
    one (share, d) every setting sees the same traffic. Progress on stderr."""
    out: list[Outcome] = []
    shares = sorted({s.share for s in settings})
    started = time.monotonic()
    for si, share in enumerate(shares):
        group = [s for s in settings if s.share == share]
        for di, d in enumerate(diffs):
            rng = np.random.default_rng([seed, si, di])
            kinds: dict[Setting, list[IntArray]] = {s: [] for s in group}
            canary_at: dict[Setting, list[FloatArray]] = {s: [] for s in group}
            total_at: dict[Setting, list[FloatArray]] = {s: [] for s in group}
            for lo in range(0, trials, TRIAL_CHUNK):
                paths = simulate_paths(share, d, min(TRIAL_CHUNK, trials - lo), horizon, rng)
                for s in group:
                    kind, at = first_decisions(paths, s.rule)
                    if lo == 0:
                        check_against_decide(paths, s.rule, kind[:10], at[:10])
                    undecided = kind == CONTINUE
                    n_c = paths.canary_n[np.arange(len(at)), at].astype(np.float64)
                    kinds[s].append(kind)
                    canary_at[s].append(np.where(undecided, math.inf, n_c))
                    total_at[s].append(np.where(undecided, math.inf, at + 1.0))
            for s in group:
                kind = np.concatenate(kinds[s])
                c_at, t_at = np.concatenate(canary_at[s]), np.concatenate(total_at[s])
                out.append(
                    Outcome(
                        s,
                        d,
                        trials,
                        float(np.mean(kind == ROLLBACK)),
                        float(np.mean(kind == PROMOTE)),
                        _quantile(c_at, 0.5),
                        _quantile(c_at, 0.9),
                        _quantile(t_at, 0.5),
                        _quantile(t_at, 0.9),
                    )
                )
            print(
                f"share {share} d {d:+.1f}: {len(group)} settings, {time.monotonic() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    return out


@dataclass(frozen=True)
class Verdict:
    """One setting judged by the rule: the first step it fails (None: it passes) and its ranking keys."""

    setting: Setting
    failed: str | None
    harm_total_p90: float  # sessions of traffic until d = HARMFUL is rolled back, p90
    helpful_total_p50: float  # sessions of traffic until d = HELPFUL is promoted, median


def apply_rule(setting: Setting, outcomes: Sequence[Outcome], max_harmed: int) -> Verdict:
    """Steps 1 to 3 of the rule (module docstring) for one setting."""
    at = {o.d: o for o in outcomes if o.setting == setting}
    failed = None
    if setting.alpha > MAX_ERROR or setting.margin > WORSE_BY:
        failed = "1 promised"
    elif any(o.p_rollback > setting.alpha for d, o in at.items() if d >= 0) or any(
        o.p_promote > setting.alpha for d, o in at.items() if d <= -setting.margin
    ):
        failed = "1 measured"
    elif any(o.p_rollback < 0.9 or o.canary_p90 > max_harmed for d, o in at.items() if d <= HARMFUL):
        failed = "2 harmed"
    elif at[HELPFUL].p_promote < 0.9:
        failed = "3 helpful"
    return Verdict(setting, failed, at[HARMFUL].total_p90, at[HELPFUL].total_p50)


def choose(verdicts: Sequence[Verdict], current: Setting) -> Setting | None:
    """Step 4 of the rule over the settings that pass (None when none does)."""
    passing = [v for v in verdicts if v.failed is None]
    if not passing:
        return None
    for key in (lambda v: v.harm_total_p90, lambda v: v.helpful_total_p50):
        best = min(key(v) for v in passing)
        passing = [v for v in passing if key(v) <= best * (1 + TIE)]

    def changed(v: Verdict) -> int:
        return sum(a != b for a, b in zip(_values(v.setting), _values(current), strict=True))

    return min(passing, key=lambda v: (changed(v), v.harm_total_p90, v.helpful_total_p50)).setting


def _values(s: Setting) -> tuple[float, float, int, float]:
    return (s.alpha, s.margin, s.min_sessions, s.share)


def grid(
    alphas: Sequence[float] = ALPHAS,
    margins: Sequence[float] = MARGINS,
    min_sessions: Sequence[int] = MIN_SESSIONS,
    shares: Sequence[float] = SHARES,
) -> list[Setting]:
    return [Setting(a, m, n, sh) for a in alphas for m in margins for sh in shares for n in min_sessions]


def _n(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.0f}"


def grid_table(verdicts: Sequence[Verdict], outcomes: Sequence[Outcome]) -> Iterator[str]:
    """One row per setting; settings that differ only in min sessions and have the same figures share a row."""
    yield (
        "| alpha | margin | share | min sessions | rollback d=0 | rollback d=+0.1 | promote d=-0.2 | promote d=-0.3 "
        "| harmful: canary p90 | harmful: total p90 | helpful: total p50 | rule |"
    )
    yield "|---|---|---|---|---|---|---|---|---|---|---|---|"
    rows: dict[tuple[float, float, float, str], list[int]] = {}
    for v in verdicts:
        s = v.setting
        at = {o.d: o for o in outcomes if o.setting == s}
        figures = (
            f"{at[0.0].p_rollback:.3f} | {at[HELPFUL].p_rollback:.3f} | {at[-WORSE_BY].p_promote:.3f} "
            f"| {at[HARMFUL].p_promote:.3f} | {_n(at[HARMFUL].canary_p90)} | {_n(at[HARMFUL].total_p90)} "
            f"| {_n(at[HELPFUL].total_p50)} | {v.failed or 'pass'}"
        )
        rows.setdefault((s.alpha, s.margin, s.share, figures), []).append(s.min_sessions)
    for (alpha, margin, share, figures), mins in rows.items():
        yield f"| {alpha} | {margin} | {share} | {', '.join(map(str, mins))} | {figures} |"


def detail_table(setting: Setting, outcomes: Sequence[Outcome]) -> Iterator[str]:
    yield "| d | P(rollback) | P(promote) | P(undecided) | canary p50 | canary p90 | total p50 | total p90 |"
    yield "|---|---|---|---|---|---|---|---|"
    for o in outcomes:
        if o.setting == setting:
            yield (
                f"| {o.d:+.1f} | {o.p_rollback:.3f} | {o.p_promote:.3f} | {o.p_undecided:.3f} "
                f"| {_n(o.canary_p50)} | {_n(o.canary_p90)} | {_n(o.total_p50)} | {_n(o.total_p90)} |"
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The canary test's defaults chosen by simulation (module docstring).")
    ap.add_argument("--trials", type=int, default=300, help="trials per setting and difference")
    ap.add_argument("--horizon", type=int, default=8000, help="sessions of traffic before a trial counts as undecided")
    ap.add_argument("--max-harmed", type=int, default=MAX_HARMED, help="the rule's step 2: canary sessions, p90")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    fields = PolicySettings.model_fields
    current = Setting(
        fields["canary_alpha"].default,
        fields["canary_margin"].default,
        fields["canary_min_sessions"].default,
        fields["canary_share"].default,
    )
    settings = grid()
    outcomes = measure(settings, DIFFS, trials=args.trials, horizon=args.horizon, seed=args.seed)
    verdicts = [apply_rule(s, outcomes, args.max_harmed) for s in settings]
    chosen = choose(verdicts, current)
    print(
        f"live mean reward {LIVE_MEAN}, {VERDICTS[0]}-{VERDICTS[1]} verdicts per session, {args.trials} trials per "
        f"cell, horizon {args.horizon} sessions of traffic, at most {args.max_harmed} harmed, seed {args.seed}"
    )
    print("\n".join(grid_table(verdicts, outcomes)))
    for label, s in (("current defaults", current), ("chosen by the rule", chosen)):
        if s is None:
            print(f"\n{label}: no setting passes the rule")
        else:
            print(f"\n{label}: alpha {s.alpha}, margin {s.margin}, min sessions {s.min_sessions}, share {s.share}")
            print("\n".join(detail_table(s, outcomes)))


if __name__ == "__main__":
    main()
