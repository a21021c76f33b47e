"""Prometheus metrics of one policy server (own registry, so several apps can live in one process).

Per-route request counts and latencies (``hindsight_policy_http_requests_total``,
``hindsight_policy_http_request_duration_seconds`` by route template, method, status) come from
engine.observability.RouteMetrics on this registry (policy_server.app), the one request-latency histogram
(chat answers and streams alike: a stream's duration runs to its last byte); this class holds the
policy-specific series.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)


class Metrics:
    # Metric declarations share the prometheus_client form by design, one per measured thing.
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
        self.samples = Gauge("hindsight_policy_samples", "samples by status", ["status"], registry=r)

    def render(self, stats: dict[str, object] | None = None) -> bytes:
        samples = (stats or {}).get("samples")
        if isinstance(samples, dict):
            for status, n in samples.items():
                self.samples.labels(status=status).set(n)
        return generate_latest(self.registry)
