"""The Grafana dashboard (deploy/grafana/) and the Prometheus scrape config (deploy/prometheus/).

Contract: ``hindsight.json`` is what ``build_dashboard.py`` writes (the file is not edited by hand);
every panel query names at least one Hindsight, SGLang or sglang-router metric and only scrape-config
job names; and the scrape config's targets are the launch scripts' default ports. That every metric series a
panel queries is exported by a running dev stack is checked on the stack of the dev-stack test, after its
demo (tests/launch/test_dev_stack.py).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from deploy.grafana import build_dashboard
from tests.launch.dashboard_check import DASHBOARD, METRIC_RE, ROOT, queried_metrics, queries

SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"


@pytest.mark.unit
def test_dashboard_is_generated_and_queries_known_jobs() -> None:
    assert json.loads(DASHBOARD.read_text()) == build_dashboard.build(), "run deploy/grafana/build_dashboard.py"
    jobs = {j["job_name"] for j in yaml.safe_load(SCRAPE.read_text())["scrape_configs"]}
    assert jobs == {"hindsight-policy", "hindsight-judge", "sglang-router", "sglang-engine"}
    for q in queries():
        assert METRIC_RE.search(q), q
        assert set(re.findall(r'job="([^"]+)"', q)) <= jobs, q
    # the judge-cost panels read the judge's token metrics
    assert {"hindsight_judge_tokens_per_turn_sum", "hindsight_judge_tokens_total"} <= queried_metrics()


@pytest.mark.unit
def test_scrape_targets_are_the_launch_scripts_default_ports() -> None:
    defaults = {}
    for script in ("policy.sh", "judge.sh"):
        defaults.update(re.findall(r"\$\{([A-Z_]+PORT):=(\d+)\}", (ROOT / "launch" / script).read_text()))
    targets = {}
    for job in yaml.safe_load(SCRAPE.read_text())["scrape_configs"]:
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                targets[(job["job_name"], sc.get("labels", {}).get("role"))] = t.split(":")[1]
    assert targets == {
        ("hindsight-policy", None): defaults["POLICY_PORT"],
        ("hindsight-judge", None): defaults["JUDGE_PORT"],
        ("sglang-router", "policy"): defaults["POLICY_ROUTER_METRICS_PORT"],
        ("sglang-router", "judge"): defaults["JUDGE_ROUTER_METRICS_PORT"],
        ("sglang-engine", "policy"): defaults["POLICY_ENGINE_BASE_PORT"],
        ("sglang-engine", "judge"): defaults["JUDGE_ENGINE_BASE_PORT"],
    }
