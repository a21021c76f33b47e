"""Prometheus metrics of one policy server (own registry, so several apps can live in one process).

Per-route request counts and latencies (``hindsight_policy_http_requests_total``,
``hindsight_policy_http_request_duration_seconds`` by route template, method, status) come from
engine.observability.RouteMetrics on this registry (policy_server.app), the one request-latency histogram
(chat answers and streams alike: a stream's duration runs to its last byte); this class holds the
policy-specific series.

Judge/feedback agreement (:class:`JudgeFeedbackCollector`) is read from the store, so every replica reports
the same figures and they survive restarts: ``hindsight_policy_judge_feedback_agreement`` (agreeing share of
the latest ``--feedback-agreement-window`` pairs; NaN while there is none), ``..._pairs`` (pairs in that
window) and ``hindsight_policy_judge_feedback_outcomes_total{outcome, verdict, feedback}`` (every feedback
settled against a verdict, by agree/disagree and the 3x3 of signs). Being store-wide, these are the same at
every replica: aggregate them across replicas with ``max``, never ``sum``. The read is refreshed on a scrape
when older than :data:`AGREEMENT_MAX_AGE_S`.

The sample series (by status, rejections by reason prefix, quarantines by guard rule, sessions that gave no
sample) are read from the store's stats at each scrape.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.records import RejectReason
from policy_server.store.feedback import JudgeAgreement, SignCounts
from policy_server.store.records import StoreCounts

# Scrapes closer together than this (several Prometheus servers, a dashboard refresh) share one store read.
AGREEMENT_MAX_AGE_S = 10.0
SIGN_LABELS = {1: "+1", 0: "0", -1: "-1"}


class JudgeFeedbackCollector(Collector):
    """The latest :class:`~policy_server.store.feedback.JudgeAgreement` read, as Prometheus families."""

    def __init__(self) -> None:
        self.latest: JudgeAgreement | None = None
        self.read_at_s = -float("inf")  # time.monotonic() of the read

    def collect(self) -> Iterator[Metric]:
        latest = self.latest
        pairs = GaugeMetricFamily(
            "hindsight_policy_judge_feedback_pairs",
            "judged turns with explicit feedback in the agreement window (the latest feedback of each)",
            value=0 if latest is None else latest.window.pairs,
        )
        yield pairs
        share = None if latest is None else latest.window.share
        # NaN, never 0, while there is nothing to compare: no alert threshold fires on it, and the series
        # still exists for the dashboard.
        yield GaugeMetricFamily(
            "hindsight_policy_judge_feedback_agreement",
            "share of the window's pairs whose judge verdict sign equals the feedback's sign (NaN: no pair)",
            value=math.nan if share is None else share,
        )
        outcomes = CounterMetricFamily(
            "hindsight_policy_judge_feedback_outcomes",
            "feedback settled against a judge PRM verdict, by outcome and by verdict x feedback sign",
            labels=["outcome", "verdict", "feedback"],
        )
        cells = SignCounts.of({}).cells if latest is None else latest.total.cells
        for v, f, n in cells:  # all nine, zeros included: rate() needs the series before its first increase
            outcomes.add_metric(["agree" if v == f else "disagree", SIGN_LABELS[v], SIGN_LABELS[f]], n)
        yield outcomes


class VersionCollector(Collector):
    """The weight-version ledger's current state (policy_server.serving.versions and .canary keep it current):
    ``hindsight_policy_weight_version{version, state}`` is 1 for the live and the canary version (a version
    timeline), ``hindsight_policy_canary_reward{arm, bound}`` the canary test's mean and interval per arm (NaN
    while no canary runs, so the series exist for the dashboard without one)."""

    def __init__(self) -> None:
        self.current: dict[str, str] = {}  # state -> version, for "live" and "canary"
        self.arms: dict[tuple[str, str], float] = {}  # (arm, bound) -> value

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "hindsight_policy_weight_version",
            "1 for the live and the canary weight version",
            labels=["version", "state"],
        )
        for state, version in sorted(self.current.items()):
            info.add_metric([version, state], 1)
        yield info
        reward = GaugeMetricFamily(
            "hindsight_policy_canary_reward",
            "canary test: per-session reward mean and always-valid interval bounds per arm (NaN: no canary)",
            labels=["arm", "bound"],
        )
        for arm in ("canary", "live"):
            for bound in ("mean", "lo", "hi"):
                reward.add_metric([arm, bound], self.arms.get((arm, bound), math.nan))
        yield reward


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine_errors = Counter(
            "hindsight_policy_engine_errors_total", "engine failures by class", ["kind"], registry=r
        )
        self.turns = Counter("hindsight_policy_turns_total", "served turns", ["turn_type"], registry=r)
        self.resumes = Counter("hindsight_policy_resumes_total", "generations resubmitted after an abort", registry=r)
        self.mismatches = Counter("hindsight_policy_history_mismatches_total", "rewritten histories", registry=r)
        self.backpressure = Counter("hindsight_policy_backpressure_total", "main turns refused (429)", registry=r)
        self.weight_updates = Counter(
            "hindsight_policy_weight_updates_total", "weight updates", ["outcome"], registry=r
        )
        self.paused_s = Gauge(
            "hindsight_policy_last_pause_seconds", "duration of the last weight-sync pause", registry=r
        )
        self.gate_waiting = Gauge("hindsight_policy_gate_waiting", "requests waiting at the weight gate", registry=r)
        self.inferred_sessions = Counter(
            "hindsight_policy_inferred_sessions_total",
            "header-less main requests by session inference outcome",
            ["outcome"],
            registry=r,
        )
        self.prompt_renders = Counter(
            "hindsight_policy_prompt_renders_total",
            "prompts by how they were made: reason=continued (token-continuous, only the new messages "
            "rendered) or why the template's full render was used (engine.continuation.RENDER_REASONS)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "hindsight_policy_prompt_tokens_total",
            "prompt tokens sent to the engine: kind=rendered (tokenized for this request), reused (taken "
            "unchanged from the turn it continues), cached (the engine's reported prefix-cache hits)",
            ["kind"],
            registry=r,
        )
        self.feedback = Counter(
            "hindsight_policy_feedback_total",
            "explicit feedback accepted, by state (late: its sample was already leased)",
            ["state"],
            registry=r,
        )
        self.session_identity = Counter(
            "hindsight_policy_session_identity_total",
            "requests by the rule that identified their session and its decision (policy_server.serving.identity)",
            ["rule", "decision"],
            registry=r,
        )
        self.side_turns = Counter(
            "hindsight_policy_side_turns_total",
            "side turns (served, never trained) by the rule that made them side",
            ["rule"],
            registry=r,
        )
        # Users' data (docs/USERS_DATA.md): opt-outs, session deletions and the retention sweeper's purges.
        self.opted_out = Counter(
            "hindsight_policy_opted_out_requests_total",
            "requests opted out of training (X-Hindsight-Train off, or none: nothing stored)",
            ["train"],
            registry=r,
        )
        self.deleted_rows = Counter(
            "hindsight_policy_deleted_rows_total",
            "rows removed by session deletions and retention sweeps, by table and cause",
            ["table", "cause"],
            registry=r,
        )
        self.retention_sweeps = Counter("hindsight_policy_retention_sweeps_total", "retention sweeps run", registry=r)
        self.retention_reclaimed_bytes = Counter(
            "hindsight_policy_retention_reclaimed_bytes_total",
            "bytes of database file returned to the filesystem by retention sweeps (SQLite)",
            registry=r,
        )
        self.samples = Gauge("hindsight_policy_samples", "samples by status", ["status"], registry=r)
        # Read from the store at each scrape (like ``samples``): exact across restarts and replicas.
        self.rejected = Gauge(
            "hindsight_policy_rejected_samples",
            "rejected samples by reason (the reject reason's prefix: degenerate, prm_neutral, judge_failed, ...)",
            ["reason"],
            registry=r,
        )
        self.quarantined = Gauge(
            "hindsight_policy_quarantined_samples",
            "samples rejected degenerate (a judge guard quarantined the reply), by guard rule",
            ["rule"],
            registry=r,
        )
        self.sessions_without_sample = Gauge(
            "hindsight_policy_sessions_without_sample",
            "ended sessions whose every turn was rejected (none trainable for the at-least-one rule to promote)",
            registry=r,
        )
        self.judge_feedback = JudgeFeedbackCollector()
        r.register(self.judge_feedback)
        self.versions = VersionCollector()
        r.register(self.versions)
        self.canary_decisions = Counter(
            "hindsight_policy_canary_decisions_total", "automatic canary decisions", ["decision"], registry=r
        )
        for decision in ("promote", "rollback"):  # zeros exported: rate() needs the series before it moves
            self.canary_decisions.labels(decision=decision)

    async def refresh_judge_feedback(
        self, read: Callable[[], JudgeAgreement], max_age_s: float = AGREEMENT_MAX_AGE_S
    ) -> None:
        """Re-read the agreement (``read`` runs in a worker thread) unless the last read is recent enough."""
        if time.monotonic() - self.judge_feedback.read_at_s < max_age_s:
            return
        self.judge_feedback.latest = await asyncio.to_thread(read)
        self.judge_feedback.read_at_s = time.monotonic()

    def render(self, stats: StoreCounts | None = None) -> bytes:
        """The Prometheus text, the store's counters (when given) set first."""
        if stats is not None:
            for status, n in stats.samples.items():
                self.samples.labels(status=status).set(n)
            self._set_rejections(stats.reject_reasons)
            self.sessions_without_sample.set(stats.sessions_without_sample)
        return generate_latest(self.registry)

    def _set_rejections(self, reasons: dict[str, int]) -> None:
        """Rejections by reason prefix and quarantines by rule, from the store's counts by full reason."""
        by_reason: Tally[str] = Tally()
        by_rule: Tally[str] = Tally()
        for reason, n in reasons.items():
            prefix, _, detail = (reason or "unknown").partition(":")
            by_reason[prefix] += n
            if prefix == RejectReason.DEGENERATE:
                by_rule[detail.strip().partition(":")[0] or "unknown"] += n
        # A reason can disappear (explicit feedback re-includes a sample): stale label values must go too.
        self.rejected.clear()
        self.quarantined.clear()
        for prefix, n in by_reason.items():
            self.rejected.labels(reason=prefix).set(n)
        for rule, n in by_rule.items():
            self.quarantined.labels(rule=rule).set(n)
