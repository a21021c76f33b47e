"""Prometheus metrics of the dev engine, named like real SGLang's (``--enable-metrics``), on one registry per app.

Contract (real SGLang's ``GET /metrics`` names and labels): ``GET /metrics`` serves, with the label
``model_name`` (the served model name, as SGLang labels them):

- ``sglang:prompt_tokens_total`` (counter): prompt tokens prefilled; a sample aborted before prefill adds 0.
- ``sglang:generation_tokens_total`` (counter): output tokens produced.
- ``sglang:num_requests_total`` (counter): finished requests, one per sample (SGLang runs each of n parallel
  samples as its own request), aborted ones included.
- ``sglang:e2e_request_latency_seconds`` (histogram): submit to finish, per prompt.
- ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` (gauges, read at scrape time): prompts past
  admission / still waiting for it (e.g. held by a pause). Counted per prompt, not per sample.

Unlike SGLang, the dev engine always serves /metrics (no flag to turn them on). The HTTP route metrics of
engine.observability (``hindsight_dev_engine_http_*``) live on the same registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from devkit.dev_server.control import EngineControl

E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, control: EngineControl) -> None:
        self.registry = registry
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry
        ).labels(model_name=model_name)
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", labels, registry=registry
        ).labels(model_name=model_name)
        self.num_requests = Counter(
            "sglang:num_requests", "Number of requests processed.", labels, registry=registry
        ).labels(model_name=model_name)
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            labels,
            buckets=E2E_BUCKETS_S,
            registry=registry,
        ).labels(model_name=model_name)
        running = Gauge("sglang:num_running_reqs", "The number of running requests.", labels, registry=registry)
        running.labels(model_name=model_name).set_function(lambda: control.request_counts()[0])
        queued = Gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels, registry=registry
        )
        queued.labels(model_name=model_name).set_function(lambda: control.request_counts()[1])

    def observe_finished(self, *, prompt_len: int, output_lens: list[int], prefilled: bool, duration_s: float) -> None:
        """One prompt finished (or aborted) with ``len(output_lens)`` samples."""
        if prefilled:
            self.prompt_tokens.inc(prompt_len * len(output_lens))
        self.generation_tokens.inc(sum(output_lens))
        self.num_requests.inc(len(output_lens))
        self.e2e_latency.observe(duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
