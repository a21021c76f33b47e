"""Prometheus metrics of the judge service, in a registry per app (tests run several apps per process).

verdicts by task and final status (after the guards), guard hits by rule and action, parse failures, votes per turn, engine tokens per turn and in total by task and
kind (prompt | cached | completion), engine calls and errors, engine call latency;
HTTP requests and latency by route template, method and status (``hindsight_judge_http_*``, recorded by
engine.observability's middleware).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from engine.observability import RouteMetrics

LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class JudgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.verdicts = Counter(
            "hindsight_judge_verdicts_total", "Task results by status", ["task", "status"], registry=r
        )
        self.guard_hits = Counter(
            "hindsight_judge_guard_hits_total",
            "Judged steps an enabled guard fired on, by rule and its configured action",
            ["rule", "action"],
            registry=r,
        )
        self.parse_failures = Counter("hindsight_judge_parse_failures_total", "Unparseable votes", ["task"], registry=r)
        self.votes_per_turn = Histogram(
            "hindsight_judge_votes_per_turn",
            "Votes drawn per task",
            ["task"],
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16),
            registry=r,
        )
        # judge cost per task and item (kind: prompt | cached | completion), and its running total
        self.tokens_per_turn = Histogram(
            "hindsight_judge_tokens_per_turn",
            "Engine tokens per task of one item",
            ["task", "kind"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tokens_total = Counter(
            "hindsight_judge_tokens_total", "Engine tokens of all judged items", ["task", "kind"], registry=r
        )
        self.engine_calls = Counter(
            "hindsight_judge_engine_calls_total", "Engine /generate calls", ["task"], registry=r
        )
        self.engine_errors = Counter("hindsight_judge_engine_errors_total", "Engine failures", ["kind"], registry=r)
        self.engine_latency = Histogram(
            "hindsight_judge_engine_call_seconds",
            "Engine call latency",
            ["task"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.routes = RouteMetrics(r, prefix="hindsight_judge", buckets_s=LATENCY_BUCKETS_S)

    def render(self) -> bytes:
        return generate_latest(self.registry)
