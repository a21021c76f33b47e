"""What the Grafana dashboard (deploy/grafana/hindsight.json) queries, and whether a live stack exports it.

Used by the dashboard's own tests (the queries name known metrics and jobs) and by the dev-stack test, which
checks, on the stack its demo has just driven (judged sessions, a trainer step, a weight update), that every
metric series a panel queries is exported by one of the stack's services: the policy server, the judge, both
routers' Prometheus ports and both engines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "hindsight.json"
METRIC_RE = re.compile(r"\b(hindsight_[a-z0-9_]+|sglang:[a-z0-9_:]+|smg_[a-z0-9_]+)\b")
# endpoints.json keys of every service Prometheus scrapes (deploy/prometheus/prometheus.yml)
SCRAPED = (
    "policy_url",
    "judge_url",
    "policy_router_metrics_url",
    "judge_router_metrics_url",
    "policy_engine_url",
    "judge_engine_url",
)


def queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def queried_metrics() -> set[str]:
    return {m for q in queries() for m in METRIC_RE.findall(q)}


def exported(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", trust_env=False, timeout=10).raise_for_status().text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def missing_dashboard_metrics(endpoints: dict[str, str]) -> list[str]:
    """The metric series the dashboard queries that no service of the running stack exports (sorted)."""
    names: set[str] = set()
    for key in SCRAPED:
        names |= exported(endpoints[key])
    return sorted(queried_metrics() - names)
