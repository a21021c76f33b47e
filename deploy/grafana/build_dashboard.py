"""Build ``deploy/grafana/hindsight.json``, the Grafana dashboard of a Hindsight deployment.

    python deploy/grafana/build_dashboard.py      (rewrites hindsight.json next to this file)

Rows: traffic and latency (policy server, routers, engines), sample pipeline, judge (verdict mix,
failures, votes and tokens per turn), weights (version updates and pause), trainer throughput (samples
consumed, updates), safe updates (the version timeline, canary vs live reward with intervals, decisions). Every query reads the Prometheus data source ``${datasource}`` with the job names
of ``deploy/prometheus/prometheus.yml`` (hindsight-policy, hindsight-judge, sglang-router, sglang-engine;
routers and engines carry a ``role`` label: policy|judge). Every metric a panel queries exists on a
running dev stack after the dev demo (judged sessions, a trainer step, a weight update;
tests/launch/test_dev_stack.py).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "hindsight.json"
DS = {"type": "prometheus", "uid": "${datasource}"}

# (row title, [(panel title, unit, [(legend, PromQL), ...], kind), ...]); kind: timeseries|stat|bars|state-timeline
ROWS = [
    (
        "Traffic and latency",
        [
            (
                "Policy server requests / s by route",
                "reqps",
                [
                    (
                        "{{route}} {{status}}",
                        'sum by (route, status) (rate(hindsight_policy_http_requests_total{job="hindsight-policy"}[$__rate_interval]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Policy server latency p50 / p95",
                "s",
                [
                    (
                        "p50 {{route}}",
                        'histogram_quantile(0.5, sum by (le, route) (rate(hindsight_policy_http_request_duration_seconds_bucket{job="hindsight-policy"}[$__rate_interval])))',
                    ),
                    (
                        "p95 {{route}}",
                        'histogram_quantile(0.95, sum by (le, route) (rate(hindsight_policy_http_request_duration_seconds_bucket{job="hindsight-policy"}[$__rate_interval])))',
                    ),
                ],
                "timeseries",
            ),
            (
                "Turns served / s",
                "reqps",
                [
                    (
                        "{{turn_type}}",
                        'sum by (turn_type) (rate(hindsight_policy_turns_total{job="hindsight-policy"}[$__rate_interval]))',
                    ),
                    (
                        "refused (429)",
                        'sum(rate(hindsight_policy_backpressure_total{job="hindsight-policy"}[$__rate_interval]))',
                    ),
                    (
                        "resumed after abort",
                        'sum(rate(hindsight_policy_resumes_total{job="hindsight-policy"}[$__rate_interval]))',
                    ),
                ],
                "timeseries",
            ),
            (
                "Router requests / s and p95",
                "reqps",
                [
                    (
                        "{{role}} {{endpoint}}",
                        'sum by (role, endpoint) (rate(smg_router_requests_total{job="sglang-router"}[$__rate_interval]))',
                    ),
                    (
                        "p95 {{role}}",
                        'histogram_quantile(0.95, sum by (le, role) (rate(smg_router_request_duration_seconds_bucket{job="sglang-router"}[$__rate_interval])))',
                    ),
                ],
                "timeseries",
            ),
            (
                "Router worker health",
                "short",
                [("{{role}} {{worker}}", 'smg_worker_health{job="sglang-router"}')],
                "timeseries",
            ),
            (
                "Engine tokens / s",
                "short",
                [
                    (
                        "prompt {{role}} {{instance}}",
                        'sum by (role, instance) (rate(sglang:prompt_tokens_total{job="sglang-engine"}[$__rate_interval]))',
                    ),
                    (
                        "generated {{role}} {{instance}}",
                        'sum by (role, instance) (rate(sglang:generation_tokens_total{job="sglang-engine"}[$__rate_interval]))',
                    ),
                ],
                "timeseries",
            ),
            (
                "Engine queue and running requests",
                "short",
                [
                    ("running {{role}} {{instance}}", 'sglang:num_running_reqs{job="sglang-engine"}'),
                    ("queued {{role}} {{instance}}", 'sglang:num_queue_reqs{job="sglang-engine"}'),
                ],
                "timeseries",
            ),
            (
                "Engine request latency p95",
                "s",
                [
                    (
                        "{{role}}",
                        'histogram_quantile(0.95, sum by (le, role) (rate(sglang:e2e_request_latency_seconds_bucket{job="sglang-engine"}[$__rate_interval])))',
                    )
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "Sample pipeline",
        [
            (
                "Samples by status",
                "short",
                [("{{status}}", 'sum by (status) (hindsight_policy_samples{job="hindsight-policy"})')],
                "timeseries",
            ),
            (
                "Samples waiting (pending judge + ready)",
                "short",
                [
                    (
                        "waiting",
                        'sum(hindsight_policy_samples{job="hindsight-policy", status=~"pending_judge|pending_score|ready"})',
                    )
                ],
                "stat",
            ),
            (
                "Rejected share",
                "percentunit",
                [
                    (
                        "rejected",
                        'sum(hindsight_policy_samples{job="hindsight-policy", status="rejected"}) / clamp_min(sum(hindsight_policy_samples{job="hindsight-policy"}), 1)',
                    )
                ],
                "stat",
            ),
        ],
    ),
    (
        "Judge",
        [
            (
                "Verdict mix / s by status",
                "short",
                [
                    (
                        "{{task}} {{status}}",
                        'sum by (task, status) (rate(hindsight_judge_verdicts_total{job="hindsight-judge"}[$__rate_interval]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Judge failures (judge_failed + no_valid_votes share)",
                "percentunit",
                [
                    (
                        "{{task}}",
                        'sum by (task) (rate(hindsight_judge_verdicts_total{job="hindsight-judge", status=~"judge_failed|no_valid_votes"}[$__rate_interval])) / clamp_min(sum by (task) (rate(hindsight_judge_verdicts_total{job="hindsight-judge"}[$__rate_interval])), 1e-9)',
                    )
                ],
                "timeseries",
            ),
            (
                "Votes per turn (mean)",
                "short",
                [
                    (
                        "{{task}}",
                        'sum by (task) (rate(hindsight_judge_votes_per_turn_sum{job="hindsight-judge"}[$__rate_interval])) / sum by (task) (rate(hindsight_judge_votes_per_turn_count{job="hindsight-judge"}[$__rate_interval]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Judge tokens per turn (mean)",
                "short",
                [
                    (
                        "{{task}} {{kind}}",
                        'sum by (task, kind) (rate(hindsight_judge_tokens_per_turn_sum{job="hindsight-judge"}[$__rate_interval])) / sum by (task, kind) (rate(hindsight_judge_tokens_per_turn_count{job="hindsight-judge"}[$__rate_interval]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Judge tokens / s",
                "short",
                [
                    (
                        "{{task}} {{kind}}",
                        'sum by (task, kind) (rate(hindsight_judge_tokens_total{job="hindsight-judge"}[$__rate_interval]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Judge engine calls / s and p95",
                "short",
                [
                    (
                        "calls {{task}}",
                        'sum by (task) (rate(hindsight_judge_engine_calls_total{job="hindsight-judge"}[$__rate_interval]))',
                    ),
                    (
                        "p95 s {{task}}",
                        'histogram_quantile(0.95, sum by (le, task) (rate(hindsight_judge_engine_call_seconds_bucket{job="hindsight-judge"}[$__rate_interval])))',
                    ),
                ],
                "timeseries",
            ),
            # Store-wide series (every policy replica exports the same values): max across replicas, never sum.
            (
                "Judge/feedback agreement",
                "percentunit",
                [
                    (
                        "latest pairs (window)",
                        'max(hindsight_policy_judge_feedback_agreement{job="hindsight-policy"})',
                    ),
                    (
                        "feedback of the last hour",
                        'sum(max by (verdict, feedback) (increase(hindsight_policy_judge_feedback_outcomes_total{job="hindsight-policy", outcome="agree"}[1h]))) / clamp_min(sum(max by (verdict, feedback) (increase(hindsight_policy_judge_feedback_outcomes_total{job="hindsight-policy"}[1h]))), 1)',
                    ),
                ],
                "timeseries",
            ),
            (
                "Feedback vs verdict sign / h",
                "short",
                [
                    (
                        "judge {{verdict}}, feedback {{feedback}}",
                        'max by (verdict, feedback) (increase(hindsight_policy_judge_feedback_outcomes_total{job="hindsight-policy"}[1h]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Agreement pairs in window",
                "short",
                [("pairs", 'max(hindsight_policy_judge_feedback_pairs{job="hindsight-policy"})')],
                "stat",
            ),
            (
                "Judge requests p95",
                "s",
                [
                    (
                        "{{route}}",
                        'histogram_quantile(0.95, sum by (le, route) (rate(hindsight_judge_http_request_duration_seconds_bucket{job="hindsight-judge"}[$__rate_interval])))',
                    )
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "Weights and trainer",
        [
            (
                "Weight updates by outcome",
                "short",
                [
                    (
                        "{{outcome}}",
                        'sum by (outcome) (increase(hindsight_policy_weight_updates_total{job="hindsight-policy"}[$__range]))',
                    )
                ],
                "stat",
            ),
            (
                "Weight-sync pause (last)",
                "s",
                [("pause", 'max(hindsight_policy_last_pause_seconds{job="hindsight-policy"})')],
                "timeseries",
            ),
            (
                "Requests waiting at the weight gate",
                "short",
                [("waiting", 'sum(hindsight_policy_gate_waiting{job="hindsight-policy"})')],
                "timeseries",
            ),
            (
                "Trainer throughput: samples consumed / min",
                "short",
                [
                    (
                        "consumed",
                        '60 * sum(deriv(hindsight_policy_samples{job="hindsight-policy", status="consumed"}[5m]))',
                    )
                ],
                "timeseries",
            ),
            (
                "Trainer steps (weight updates) / h",
                "short",
                [
                    (
                        "ok",
                        '3600 * sum(rate(hindsight_policy_weight_updates_total{job="hindsight-policy", outcome="ok"}[$__rate_interval]))',
                    )
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "Safe updates (docs/SAFE_UPDATES.md)",
        [
            (
                "Weight version timeline (live, canary)",
                "short",
                [
                    (
                        "{{state}} {{version}}",
                        'max by (version, state) (hindsight_policy_weight_version{job="hindsight-policy"})',
                    )
                ],
                "state-timeline",
            ),
            (
                "Canary vs live reward per session, always-valid intervals",
                "short",
                [
                    (
                        "{{arm}} {{bound}}",
                        'max by (arm, bound) (hindsight_policy_canary_reward{job="hindsight-policy"})',
                    )
                ],
                "timeseries",
            ),
            (
                "Automatic canary decisions",
                "short",
                [
                    (
                        "{{decision}}",
                        'sum by (decision) (increase(hindsight_policy_canary_decisions_total{job="hindsight-policy"}[$__range]))',
                    )
                ],
                "stat",
            ),
        ],
    ),
]


def panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], kind: str, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 8 if kind != "stat" else 6, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        for title, unit, targets, kind in row_panels:
            w = 8 if kind != "stat" else 6
            if x + w > 24:
                x, y = 0, y + 8
            panels.append(panel(pid, title, unit, targets, kind, x, y))
            pid, x = pid + 1, x + w
        y += 8
    return {
        "uid": "hindsight-overview",
        "title": "Hindsight",
        "tags": ["hindsight", "rl"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                }
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(OUT)
