"""hindsight-judge-eval's metrics on small hand-computed cases (judge_server.eval.metrics).

Contract pinned: no verdict is wrong and counted missing (a None and an absent key alike); macro-F1 is the mean
of the three per-class F1s with 0 for an empty denominator; kappa counts missing as its own predicted category;
first-error accuracy compares the first -1 step per trajectory (or none), a missing verdict never being a -1;
bootstrap intervals are a function of the seed.
"""

from __future__ import annotations

import random

import pytest

from judge_server.eval.metrics import GoldLabel, bootstrap_intervals, constant_verdicts, first_error_accuracy, score

pytestmark = pytest.mark.unit

# Two trajectories: t1 steps 2/4/6 labelled 1/-1/-1, t2 steps 2/4 labelled 1/0.
GOLD = [GoldLabel(1, 2, 1), GoldLabel(1, 4, -1), GoldLabel(1, 6, -1), GoldLabel(2, 2, 1), GoldLabel(2, 4, 0)]
# t1: right, wrong (+1 for a -1), right; t2: no verdict, right.
PRED = {(1, 2): 1, (1, 4): 1, (1, 6): -1, (2, 2): None, (2, 4): 0}


def test_hand_computed_figures() -> None:
    s = score(GOLD, PRED)
    assert s.steps == 5 and s.trajectories == 2 and s.missing == 1
    assert s.confusion == ((1, 0, 0, 1), (0, 1, 0, 0), (1, 0, 1, 0))
    assert s.accuracy == pytest.approx(3 / 5)
    # +1: 1 right of 2 predicted, of 2 gold; 0: 1/1, 1/1; -1: 1/1 predicted, 1 of 2 gold
    assert (s.classes[1].precision, s.classes[1].recall, s.classes[1].f1) == pytest.approx((0.5, 0.5, 0.5))
    assert (s.classes[0].precision, s.classes[0].recall, s.classes[0].f1) == pytest.approx((1.0, 1.0, 1.0))
    assert (s.classes[-1].precision, s.classes[-1].recall) == pytest.approx((1.0, 0.5))
    assert s.f1_bad == pytest.approx(2 / 3)
    assert s.macro_f1 == pytest.approx((0.5 + 1.0 + 2 / 3) / 3)
    # p_o = 3/5; p_e = (2*2 + 1*1 + 2*1) / 25 (missing is no class's prediction)
    p_e = 7 / 25
    assert s.kappa == pytest.approx((3 / 5 - p_e) / (1 - p_e))
    # t1: first gold -1 at 4, first predicted -1 at 6 (wrong); t2: none and none (right)
    assert s.first_error_accuracy == pytest.approx(0.5)


def test_absent_key_is_the_same_as_no_verdict() -> None:
    absent = {k: v for k, v in PRED.items() if v is not None}
    assert score(GOLD, absent) == score(GOLD, PRED)


def test_no_verdict_is_wrong_even_where_any_label_would_do() -> None:
    gold = [GoldLabel(1, 2, 0)]
    assert score(gold, {(1, 2): None}).accuracy == 0.0
    assert score(gold, {(1, 2): 0}).accuracy == 1.0


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        ({(1, 2): 1, (1, 4): -1, (1, 6): 1}, 1.0),  # first -1 found exactly; later steps do not matter
        ({(1, 2): 1, (1, 4): -1, (1, 6): -1}, 1.0),
        ({(1, 2): -1, (1, 4): -1, (1, 6): -1}, 0.0),  # a -1 too early
        ({(1, 2): 1, (1, 4): None, (1, 6): -1}, 0.0),  # missing is not a -1: the first -1 is then step 6
        ({(1, 2): 1, (1, 4): 0, (1, 6): 1}, 0.0),  # none found where there is one
    ],
)
def test_first_error_accuracy(verdicts: dict[tuple[int, int], int | None], expected: float) -> None:
    assert first_error_accuracy(GOLD[:3], verdicts) == expected


def test_first_error_none_where_there_is_none() -> None:
    gold = [GoldLabel(7, 2, 1), GoldLabel(7, 4, 0)]
    assert first_error_accuracy(gold, {(7, 2): 1, (7, 4): None}) == 1.0
    assert first_error_accuracy(gold, {(7, 2): 1, (7, 4): -1}) == 0.0


def test_kappa_edges() -> None:
    assert score(GOLD, {(g.trajectory_id, g.message_index): g.label for g in GOLD}).kappa == pytest.approx(1.0)
    # always +1: agreement is exactly the chance agreement
    assert score(GOLD, constant_verdicts(GOLD, 1)).kappa == pytest.approx(0.0)
    # no variation at all (p_e = 1): defined as 0, not a division by zero
    gold = [GoldLabel(1, 2, 1), GoldLabel(1, 4, 1)]
    assert score(gold, constant_verdicts(gold, 1)).kappa == 0.0


def test_macro_f1_counts_an_empty_class_as_zero() -> None:
    s = score(GOLD, constant_verdicts(GOLD, 1))
    assert s.classes[0].f1 == 0.0 and s.classes[-1].f1 == 0.0
    assert s.macro_f1 == pytest.approx((2 * (2 / 5) / (2 / 5 + 1)) / 3)


def test_bootstrap_is_seeded_and_brackets_the_estimate() -> None:
    rng = random.Random(3)  # irregular data, so that intervals vary with the resamples drawn
    gold = [
        GoldLabel(t, i, rng.choice((1, 1, 0, -1))) for t in range(40) for i in range(2, 2 + 2 * rng.randint(1, 5), 2)
    ]
    verdicts = {
        (g.trajectory_id, g.message_index): g.label if rng.random() < 0.7 else rng.choice((1, 0, -1, None))
        for g in gold
    }
    first = bootstrap_intervals(gold, verdicts, resamples=300, seed=7)
    assert first == bootstrap_intervals(gold, verdicts, resamples=300, seed=7)
    assert first != bootstrap_intervals(gold, verdicts, resamples=300, seed=8)
    assert first is not None
    point = score(gold, verdicts)
    assert first[0].lo <= point.macro_f1 <= first[0].hi
    assert first[1].lo <= point.kappa <= first[1].hi
    assert first[0].lo < first[0].hi
    assert bootstrap_intervals(gold, verdicts, resamples=0, seed=7) is None


def test_bootstrap_of_one_trajectory_is_the_point_estimate() -> None:
    # every resample draws the only trajectory: the interval collapses onto score()'s figures
    gold = GOLD[:3]
    intervals = bootstrap_intervals(gold, PRED, resamples=50, seed=0)
    assert intervals is not None
    point = score(gold, PRED)
    assert (intervals[0].lo, intervals[0].hi) == pytest.approx((point.macro_f1, point.macro_f1))
    assert (intervals[1].lo, intervals[1].hi) == pytest.approx((point.kappa, point.kappa))
