"""Structured observations and metrics: observation validation, schema stability per
scorer and metric, metric names, weighted rewards vs unweighted observations, count-weighted combination
across workers, eval namespace, Prometheus exposure and the log snapshot."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prm import (
    PRMMetricObservation,
    PRMRejected,
    PRMRunner,
    PRMStats,
    combine_stats,
    register_prometheus,
    score_session,
)
from prm.metrics import MetricKey
from prm.scorers import LengthBudgetScorer
from tests.prm.prm_test_scorers import Observing, make_turns, obs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"value": 1.0, "value_type": "boolean", "aggregations": ("rate",)}, TypeError, "must be a bool"),
        ({"value": True, "value_type": "float", "aggregations": ("mean",)}, TypeError, "must be a number"),
        ({"value": float("nan"), "value_type": "float", "aggregations": ("mean",)}, ValueError, "finite"),
        ({"value": True, "value_type": "boolean", "aggregations": ("sum",)}, ValueError, "boolean values allow"),
        ({"value": 1.0, "value_type": "float", "aggregations": ("rate",)}, ValueError, "float values allow"),
        ({"value": 1.0, "value_type": "float", "aggregations": ()}, ValueError, "non-empty and unique"),
        ({"value": 1.0, "value_type": "float", "aggregations": ("sum", "sum")}, ValueError, "non-empty and unique"),
        ({"value": 1.0, "value_type": "int", "aggregations": ("sum",)}, ValueError, "value_type"),
        ({"value": 1.0, "value_type": "float", "aggregations": ("sum",), "scope": "step"}, ValueError, "scope"),
        ({"value": 1.0, "value_type": "float", "aggregations": ("sum",), "metric_id": " "}, ValueError, "metric_id"),
    ],
)
def test_observation_validation(kwargs, error, match):
    base = {"metric_id": "m", "scope": "turn", "target_id": "t"}
    with pytest.raises(error, match=match):
        PRMMetricObservation(**{**base, **kwargs})


async def test_turn_observation_must_target_its_turn():
    runner = PRMRunner({"scorers": [Observing(lambda it: [obs("m", "elsewhere", True, "boolean", ("rate",))])]})
    with pytest.raises(PRMRejected, match="targets 'elsewhere', expected 's1:0'"):
        await score_session(runner, make_turns(1))


async def test_duplicate_observation_rejected():
    runner = PRMRunner({"scorers": [Observing(lambda it: [obs("m", "traj", 1.0, "float", ("sum",), "trajectory")])]})
    with pytest.raises(PRMRejected, match="duplicate observation"):
        await score_session(runner, make_turns(2))  # both turns emit the same trajectory observation


async def test_schema_stable_within_and_across_runs():
    def within(it):
        if it.turn_index == 0:
            return [obs("m", it.interaction_id, True, "boolean", ("rate",))]
        return [obs("m", it.interaction_id, True, "boolean", ("count", "rate"))]

    with pytest.raises(PRMRejected, match="schema changed within one run"):
        await score_session(PRMRunner({"scorers": [Observing(within)]}), make_turns(2))

    schema = {"aggs": ("rate",)}
    runner = PRMRunner(
        {"scorers": [Observing(lambda it: [obs("m", it.interaction_id, True, "boolean", schema["aggs"])])]}
    )
    await score_session(runner, make_turns(2))
    await score_session(runner, make_turns(2, session_id="s2"))  # same schema: fine
    schema["aggs"] = ("count",)
    with pytest.raises(PRMRejected, match="schema changed across runs"):
        await score_session(runner, make_turns(1, session_id="s3"))
    # A rejected run binds nothing and publishes nothing new.
    assert runner.metrics.snapshot()["rollout/prm_metric/turn/observing/m/observed_count"] == 4.0


async def test_metric_names_weighted_rewards_unweighted_observations():
    runner = PRMRunner({"scorers": [LengthBudgetScorer(max_output_tokens=3, weight=2.0)]})
    await score_session(runner, make_turns(3))  # output lengths 2, 3, 4: two within budget
    snap = runner.metrics.snapshot()
    assert snap["rollout/prm_turn_reward/length_budget"] == pytest.approx(2 * 2.0 / 3)  # weighted mean
    assert snap["rollout/prm_trajectory_reward/length_budget"] == pytest.approx(4.0)  # per-branch weighted sum
    assert snap["rollout/prm_metric/turn/length_budget/within_budget/count"] == 2.0  # unweighted
    assert snap["rollout/prm_metric/turn/length_budget/within_budget/rate"] == pytest.approx(2 / 3)
    assert snap["rollout/prm_metric/turn/length_budget/within_budget/observed_count"] == 3.0
    assert snap["rollout/prm_metric/turn/length_budget/output_tokens/sum"] == 9.0
    assert snap["rollout/prm_metric/turn/length_budget/output_tokens/mean"] == 3.0

    await score_session(runner, make_turns(1, session_id="e1"), is_eval=True)
    snap = runner.metrics.snapshot()
    assert snap["eval-rollout/prm_metric/turn/length_budget/within_budget/rate"] == 1.0
    assert snap["rollout/prm_metric/turn/length_budget/within_budget/observed_count"] == 3.0


def test_aggregation_arithmetic_across_workers():
    rate = MetricKey("rollout", "metric", "s", "turn", "ok", "rate")
    count = MetricKey("rollout", "metric", "s", "turn", "ok", "count")
    mean = MetricKey("rollout", "metric", "s", "turn", "len", "mean")
    total = MetricKey("rollout", "metric", "s", "turn", "len", "sum")
    w1, w2 = PRMStats(), PRMStats()
    w1.add(rate, 1.0), w1.add(count, 1.0), w1.add(mean, 10.0), w1.add(total, 10.0)  # 1 observation
    for v in (0.0, 0.0, 0.0):  # 3 observations, all False
        w2.add(rate, v), w2.add(count, v)
    for v in (2.0, 4.0, 6.0):
        w2.add(mean, v), w2.add(total, v)
    # Transport round trip must not lose the counts.
    combined = combine_stats([PRMStats.from_json(w1.to_json()), PRMStats.from_json(w2.to_json())])
    snap = combined.snapshot()
    assert snap["rollout/prm_metric/turn/s/ok/rate"] == pytest.approx(0.25)  # not (1.0 + 0.0) / 2
    assert snap["rollout/prm_metric/turn/s/ok/count"] == 1.0
    assert snap["rollout/prm_metric/turn/s/len/mean"] == pytest.approx(22.0 / 4)  # not (10 + 4) / 2
    assert snap["rollout/prm_metric/turn/s/len/sum"] == 22.0
    assert snap["rollout/prm_metric/turn/s/len/observed_count"] == 4.0


def test_metric_ids_cannot_add_path_levels():
    key = MetricKey("rollout", "metric", "my/scorer", "turn", "a/b c", "sum")
    assert key.name == "rollout/prm_metric/turn/my%2Fscorer/a%2Fb%20c/sum"


async def test_prometheus_exposure_and_drained_window():
    runner = PRMRunner({"scorers": [LengthBudgetScorer(max_output_tokens=2)]})
    registry = CollectorRegistry()
    register_prometheus(registry, runner.metrics)
    await score_session(runner, make_turns(2))
    text = generate_latest(registry).decode()
    assert 'hindsight_prm_turn_reward{namespace="rollout",scorer="length_budget"} 0.5' in text
    assert (
        'hindsight_prm_metric{aggregation="rate",metric="within_budget",namespace="rollout",'
        'scope="turn",scorer="length_budget"} 0.5'
    ) in text
    assert 'hindsight_prm_sessions_total{namespace="rollout",outcome="scored"} 1.0' in text
    window = runner.metrics.drain_window()
    assert window["rollout/prm_turn_reward/length_budget"] == 0.5
    assert runner.metrics.drain_window() == {}
    await score_session(runner, make_turns(1, session_id="s2"))
    text = generate_latest(registry).decode()  # cumulative over both sessions: 2 of 3 within budget
    assert (
        'hindsight_prm_observed_count{family="turn_reward",metric="",namespace="rollout",scope="",scorer="length_budget"} 3.0'
        in text
    )
