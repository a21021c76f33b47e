"""The canary-defaults bench's core (bench/canary_defaults.py), on a tiny grid; never its timings.

Contract: the vectorised replay (bench.sequential_replay, also what tests/unit/test_sequential.py measures the
test's guarantees with) decides exactly as engine.sequential.decide, look by look, on the bench's traffic; the
replay's check raises when they disagree; the simulation
is seeded (same seed, same figures) and orders the cases as the test must (a clearly harmful canary is rolled
back, a clearly helpful one promoted); the rule refuses a setting whose promise is weaker than 5% or whose
harmful canary serves too many users, and among the rest picks the shortest harmful trial, a tie keeping the
current defaults' values.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench import canary_defaults as cd
from bench.sequential_replay import DECISIONS, PROMOTE, ROLLBACK, check_against_decide, first_decisions

pytestmark = pytest.mark.unit

SETTING = cd.Setting(alpha=0.05, margin=0.2, min_sessions=20, share=0.5)


@pytest.mark.parametrize("d", [-0.8, 0.0, 0.6])
def test_the_replay_decides_as_decide_at_every_session(d: float) -> None:
    paths = cd.simulate_paths(SETTING.share, d, trials=4, sessions=400, rng=np.random.default_rng(3))
    kind, at = first_decisions(paths, SETTING.rule)
    for t in range(4):
        first = ("continue", 399)
        for i in range(400):
            got = SETTING.rule.decide(*paths.arms(t, i))
            if got != "continue":
                first = (got, i)
                break
        assert (DECISIONS[int(kind[t])], int(at[t])) == first
    check_against_decide(paths, SETTING.rule, kind, at)
    wrong = kind.copy()
    wrong[0] = ROLLBACK if kind[0] != ROLLBACK else PROMOTE
    with pytest.raises(RuntimeError, match="decide says"):
        check_against_decide(paths, SETTING.rule, wrong, at)


def test_session_rewards_are_means_of_verdicts_around_the_arm_mean() -> None:
    paths = cd.simulate_paths(0.5, -0.3, trials=20, sessions=2000, rng=np.random.default_rng(1))
    canary_mean = paths.canary_sum[:, -1].sum() / (cd.SCALE * paths.canary_n[:, -1].sum())
    live_mean = paths.live_sum[:, -1].sum() / (cd.SCALE * paths.live_n[:, -1].sum())
    assert canary_mean == pytest.approx(cd.LIVE_MEAN - 0.3, abs=0.02)
    assert live_mean == pytest.approx(cd.LIVE_MEAN, abs=0.02)
    assert paths.canary_n[:, -1].sum() / (20 * 2000) == pytest.approx(0.5, abs=0.01)


def test_measure_is_seeded_and_orders_the_cases() -> None:
    def run() -> list[cd.Outcome]:
        return cd.measure([SETTING], [-0.8, 0.6], trials=20, horizon=600, seed=5)

    harmful, helpful = run()
    assert run() == [harmful, helpful]
    assert harmful.p_rollback == 1.0 and helpful.p_promote == 1.0
    assert harmful.canary_p50 <= harmful.canary_p90 < harmful.total_p90  # canary sessions are part of the traffic
    assert harmful.p_undecided == 0.0


def outcome(setting: cd.Setting, d: float, *, rollback: float, promote: float, canary: float, total: float):
    return cd.Outcome(setting, d, 100, rollback, promote, canary, canary, total, total)


def outcomes_for(setting: cd.Setting, *, harmed: float, harm_total: float, helpful_total: float) -> list:
    rows = []
    for d in cd.DIFFS:
        if d <= cd.HARMFUL:
            rows.append(outcome(setting, d, rollback=1.0, promote=0.0, canary=harmed, total=harm_total))
        elif d >= 0:
            rows.append(outcome(setting, d, rollback=0.0, promote=1.0, canary=100, total=helpful_total))
        else:
            rows.append(outcome(setting, d, rollback=0.5, promote=0.0, canary=100, total=500))
    return rows


def test_the_rule_refuses_weak_promises_and_harm_then_picks_the_shortest_harmful_trial() -> None:
    current = cd.Setting(0.05, 0.2, 20, 0.2)
    loose = cd.Setting(0.1, 0.2, 20, 0.2)  # promises 10%
    wide = cd.Setting(0.05, 0.2, 20, 0.5)  # exposes too many users
    slow = cd.Setting(0.05, 0.2, 20, 0.1)
    same = cd.Setting(0.05, 0.2, 10, 0.2)  # the same figures as current
    data = (
        outcomes_for(current, harmed=400, harm_total=2000, helpful_total=1200)
        + outcomes_for(loose, harmed=300, harm_total=1500, helpful_total=900)
        + outcomes_for(wide, harmed=800, harm_total=1600, helpful_total=1000)
        + outcomes_for(slow, harmed=300, harm_total=3000, helpful_total=2200)
        + outcomes_for(same, harmed=400, harm_total=2000, helpful_total=1200)
    )
    verdicts = [cd.apply_rule(s, data, max_harmed=500) for s in (current, loose, wide, slow, same)]
    assert [v.failed for v in verdicts] == [None, "1 promised", "2 harmed", None, None]
    assert cd.choose(verdicts, current) == current
    assert cd.choose(verdicts, same) == same  # a tie keeps whichever is in force
    measured_false_rollback = [
        o if o.d != 0.0 else outcome(current, 0.0, rollback=0.1, promote=0.9, canary=100, total=1200)
        for o in outcomes_for(current, harmed=400, harm_total=2000, helpful_total=1200)
    ]
    assert cd.apply_rule(current, measured_false_rollback, max_harmed=500).failed == "1 measured"
