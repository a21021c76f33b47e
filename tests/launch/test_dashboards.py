"""The Grafana dashboard (deploy/grafana/) and the Prometheus scrape config (deploy/prometheus/).

Contract: ``hindsight.json`` is what ``build_dashboard.py`` writes (the file is not edited by hand);
every panel query names at least one Hindsight, SGLang or sglang-router metric and only scrape-config
job names; the scrape config's targets are the launch scripts' default ports; and every metric series a
panel queries is exported by a running dev stack (llm judge) after one judged session and one weight
update, scraped from the policy server, the judge, both routers' Prometheus ports and both engines.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.grafana import build_dashboard
from tests.testkit.procs import dev_sh as dev

ROOT = Path(__file__).resolve().parents[2]

DASHBOARD = ROOT / "deploy" / "grafana" / "hindsight.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRIC_RE = re.compile(r"\b(hindsight_[a-z0-9_]+|sglang:[a-z0-9_:]+|smg_[a-z0-9_]+)\b")
DEADLINE_S = 120.0


def queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def queried_metrics() -> set[str]:
    return {m for q in queries() for m in METRIC_RE.findall(q)}


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


def exported(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", trust_env=False, timeout=10).raise_for_status().text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)  # a whole dev stack (two engines, two routers, judge, policy) on shared CPUs
def test_every_dashboard_metric_exists_on_a_live_dev_stack(
    tmp_path: Path, tiny_model_dir: Path, teacher_model_dir: Path
) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "policy")
    shutil.copytree(teacher_model_dir, tmp_path / "models" / "teacher")
    try:
        res = dev("start", tmp_path, 240)
        assert res.returncode == 0, res.stdout + res.stderr
        ep = json.loads((tmp_path / "endpoints.json").read_text())
        user = {"Authorization": f"Bearer {ep['api_key']}", "X-Session-Id": "dash-1"}
        admin = {"Authorization": f"Bearer {ep['admin_api_key']}"}
        with httpx.Client(base_url=ep["policy_url"], trust_env=False, timeout=120) as c:
            msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
            for text, done in (("Thanks, that worked.", False), ("Bye.", True)):
                r = c.post(
                    "/v1/chat/completions",
                    json={"model": "hindsight-policy", "messages": msgs, "max_tokens": 8},
                    headers={**user, **({"X-Session-Done": "true"} if done else {})},
                ).raise_for_status()
                reply = r.json()["choices"][0]["message"].get("content") or ""
                msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": text}]
            end = time.monotonic() + DEADLINE_S
            while True:  # the first turn is judged (the llm judge calls its engine through the judge router)
                rows = (
                    c.get("/v1/samples", params={"session_id": "dash-1"}, headers=admin)
                    .raise_for_status()
                    .json()["samples"]
                )
                if len(rows) == 2 and all(r["status"] != "pending_judge" for r in rows):
                    break
                assert time.monotonic() < end, rows
                time.sleep(0.2)
            up = (
                c.post(
                    "/admin/weights/update",
                    json={"model_path": ep["policy_model_path"], "weight_version": "1"},
                    headers=admin,
                    timeout=120,
                )
                .raise_for_status()
                .json()
            )
            assert up["success"], up
        names: set[str] = set()
        for key in (
            "policy_url",
            "judge_url",
            "policy_router_metrics_url",
            "judge_router_metrics_url",
            "policy_engine_url",
            "judge_engine_url",
        ):
            names |= exported(ep[key])
    finally:
        dev("stop", tmp_path, 90)
    missing = sorted(queried_metrics() - names)
    assert missing == [], f"dashboard queries metrics no dev-stack service exports: {missing}"
