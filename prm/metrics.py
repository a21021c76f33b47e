"""PRM metrics: mergeable stats, the names AReaL publishes, a Prometheus collector and a log snapshot.

Names (namespace ``rollout``, or ``eval-rollout`` for evaluation traffic)::

    <ns>/prm_turn_reward/<scorer>                              mean over turns of the WEIGHTED per-token mean
    <ns>/prm_trajectory_reward/<scorer>                        mean over branches of the per-branch weighted sum
    <ns>/prm_metric/<scope>/<scorer>/<metric>/<aggregation>    UNWEIGHTED observations: count | rate | sum | mean
    <ns>/prm_metric/<scope>/<scorer>/<metric>/observed_count   the denominator of the line above

Arithmetic: every stat carries ``(total, count)``. Merging stats from several workers adds both, so means and
rates come out weighted by observation counts (never a mean of means) while counts and sums simply add.
``count`` of a boolean is the number of ``True`` observations; ``rate`` is that over ``observed_count``.

Nothing here decides *when* to publish: the branch exporter records a session's stats only after every
branch succeeded (failed sessions publish no partial observations).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from prm.types import PRMTurnResult

TRAIN_NAMESPACE = "rollout"
EVAL_NAMESPACE = "eval-rollout"
_MEAN_LIKE = frozenset({"mean", "rate"})


def namespace_for(is_eval: bool) -> str:
    return EVAL_NAMESPACE if is_eval else TRAIN_NAMESPACE


def _seg(value: str) -> str:
    # User-chosen ids must not add path levels to the metric name.
    return quote(value, safe="-_.:")


@dataclass(frozen=True, order=True)
class MetricKey:
    """One published series: family is turn_reward | trajectory_reward | metric."""

    namespace: str
    family: str
    scorer: str
    scope: str = ""
    metric: str = ""
    aggregation: str = "mean"

    @property
    def base(self) -> str:
        if self.family == "metric":
            return f"{self.namespace}/prm_metric/{self.scope}/{_seg(self.scorer)}/{_seg(self.metric)}"
        return f"{self.namespace}/prm_{self.family}/{_seg(self.scorer)}"

    @property
    def name(self) -> str:
        return f"{self.base}/{self.aggregation}" if self.family == "metric" else self.base


class PRMStats:
    """A bag of ``MetricKey -> [total, count]`` that merges by adding (see module docstring)."""

    def __init__(self) -> None:
        self._stats: dict[MetricKey, list[float]] = {}

    def add(self, key: MetricKey, value: float, count: int = 1) -> None:
        slot = self._stats.setdefault(key, [0.0, 0])
        slot[0] += float(value)
        slot[1] += count

    def merge(self, other: PRMStats) -> PRMStats:
        for key, (total, count) in other._stats.items():
            self.add(key, total, int(count))
        return self

    def items(self) -> Iterator[tuple[MetricKey, float, int]]:
        for key in sorted(self._stats):
            total, count = self._stats[key]
            yield key, total, int(count)

    def value(self, key: MetricKey) -> float:
        """Resolved value: total/count for mean and rate, the total for count and sum."""
        total, count = self._stats[key]
        return total / count if (key.aggregation in _MEAN_LIKE and count) else total

    def count(self, key: MetricKey) -> int:
        return int(self._stats[key][1])

    def __len__(self) -> int:
        return len(self._stats)

    def snapshot(self) -> dict[str, float]:
        """Flat ``name -> value`` for the trainer's logs (means resolved, observed_count added)."""
        out: dict[str, float] = {}
        for key, _total, count in self.items():
            out[key.name] = self.value(key)
            if key.family == "metric":
                out[f"{key.base}/observed_count"] = float(count)
        return out

    def to_json(self) -> list[dict[str, Any]]:
        """Transport form (per session ``prm_stats``); ``from_json`` of it merges losslessly."""
        return [{**key.__dict__, "total": total, "count": count} for key, total, count in self.items()]

    @classmethod
    def from_json(cls, rows: Iterable[Mapping[str, Any]]) -> PRMStats:
        stats = cls()
        for row in rows:
            key = MetricKey(**{k: row[k] for k in MetricKey.__dataclass_fields__ if k in row})
            stats.add(key, float(row["total"]), int(row["count"]))
        return stats


def combine_stats(parts: Iterable[PRMStats]) -> PRMStats:
    """Combine workers' stats: counts/sums add, means/rates weighted by observation counts."""
    out = PRMStats()
    for part in parts:
        out.merge(part)
    return out


def build_stats(
    turn_results: Sequence[PRMTurnResult],
    branch_totals: Sequence[Mapping[str, float]],
    *,
    is_eval: bool,
) -> PRMStats:
    """Stats of one successfully scored session: its committed turn results and per-branch totals."""
    ns = namespace_for(is_eval)
    stats = PRMStats()
    for res in turn_results:
        stats.add(MetricKey(ns, "turn_reward", res.scorer_name), res.reward)
        for obs in res.observations:
            for agg in obs.aggregations:
                stats.add(MetricKey(ns, "metric", res.scorer_name, obs.scope, obs.metric_id, agg), float(obs.value))
    for totals in branch_totals:
        for scorer, total in totals.items():
            stats.add(MetricKey(ns, "trajectory_reward", scorer), total)
    return stats


class PRMMetrics:
    """Process-wide accumulator: cumulative stats (Prometheus) plus a drainable window (trainer logs)."""

    def __init__(self) -> None:
        self.cumulative = PRMStats()
        self._window = PRMStats()
        self.sessions: dict[tuple[str, str], int] = {}

    def record(self, stats: PRMStats) -> None:
        self.cumulative.merge(stats)
        self._window.merge(stats)

    def count_session(self, *, is_eval: bool, outcome: str) -> None:
        """outcome: scored | rejected | discarded."""
        key = (namespace_for(is_eval), outcome)
        self.sessions[key] = self.sessions.get(key, 0) + 1

    def snapshot(self) -> dict[str, float]:
        return self.cumulative.snapshot()

    def drain_window(self) -> dict[str, float]:
        """Stats since the last drain, as a flat dict; the window is reset."""
        window, self._window = self._window, PRMStats()
        return window.snapshot()


class PRMCollector(Collector):
    """Exposes a ``PRMMetrics`` on a prometheus_client registry, read live at scrape time."""

    def __init__(self, metrics: PRMMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        turn = GaugeMetricFamily(
            "hindsight_prm_turn_reward", "Mean weighted PRM turn reward", labels=["namespace", "scorer"]
        )
        traj = GaugeMetricFamily(
            "hindsight_prm_trajectory_reward", "Mean per-branch weighted PRM reward sum", labels=["namespace", "scorer"]
        )
        metric = GaugeMetricFamily(
            "hindsight_prm_metric",
            "Structured scorer observation aggregate (unweighted)",
            labels=["namespace", "scope", "scorer", "metric", "aggregation"],
        )
        observed = GaugeMetricFamily(
            "hindsight_prm_observed_count",
            "Observations behind each PRM series",
            labels=["namespace", "family", "scope", "scorer", "metric"],
        )
        seen: set[tuple[str, ...]] = set()
        for key, total, count in self.metrics.cumulative.items():
            value = total / count if (key.aggregation in _MEAN_LIKE and count) else total
            if key.family == "turn_reward":
                turn.add_metric([key.namespace, key.scorer], value)
            elif key.family == "trajectory_reward":
                traj.add_metric([key.namespace, key.scorer], value)
            else:
                metric.add_metric([key.namespace, key.scope, key.scorer, key.metric, key.aggregation], value)
            obs_labels = (key.namespace, key.family, key.scope, key.scorer, key.metric)
            if obs_labels not in seen:
                seen.add(obs_labels)
                observed.add_metric(list(obs_labels), float(count))
        sessions = CounterMetricFamily(
            "hindsight_prm_sessions", "Sessions by PRM scoring outcome", labels=["namespace", "outcome"]
        )
        for (ns, outcome), n in sorted(self.metrics.sessions.items()):
            sessions.add_metric([ns, outcome], n)
        yield from (turn, traj, metric, observed, sessions)


def register_prometheus(registry: CollectorRegistry, metrics: PRMMetrics) -> PRMCollector:
    """Register ``metrics`` on ``registry`` (call once per registry); values update at every scrape."""
    collector = PRMCollector(metrics)
    registry.register(collector)
    return collector
