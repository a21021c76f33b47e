"""The soak's short form (bench/soak.py --short) on the one-machine cluster (launch/cluster.sh), end to end.

Contract: the cluster starts every part on its own loopback address (PostgreSQL, 3 policy replicas and 2 judge
servers behind HAProxy, 2+2 engines behind sglang-routers, a 2-rank torchrun trainer) and ``stop`` leaves none
of them running; under load over chat completions, Responses, Messages and header-less OpenClaw-shaped
transcripts, with a policy replica, a judge server and a judge engine killed -9, PostgreSQL restarted and weight
updates every 15 s: 0 lost, recorded = answered, every recorded turn paired and judged, each leased sample in
exactly one lease, at-least-one held for every closed session, every failed request explained by a fault, every
weight update reaching every live replica. Needs Debian's haproxy and postgresql (skips without them, with
the reason; CI installs both in .ci/run and fails instead).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.process, pytest.mark.timeout(600)]


def require_packages() -> None:
    from devkit.pgcluster import PgUnavailable, pg_bindir

    missing = [] if shutil.which("haproxy") or Path("/usr/sbin/haproxy").exists() else ["haproxy"]
    try:
        pg_bindir()
    except PgUnavailable:
        missing.append("postgresql")
    if missing:
        msg = f"the cluster needs Debian's {' and '.join(missing)} (apt-get install -y {' '.join(missing)})"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def test_short_soak_keeps_every_invariant(tmp_path: Path) -> None:
    require_packages()
    from bench import soak

    report = soak.main(["--short", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "soak.json").read_text())["store"] == report["store"]
    assert "<svg" in (tmp_path / "soak.html").read_text()

    # The cluster: every host on its own loopback address, nothing left running after stop.
    names = {e["name"] for e in report["cluster"]}
    assert {"postgres", "haproxy", "policy-1", "policy-2", "policy-3", "judge-1", "judge-2"} <= names
    assert {"policy-engine-1", "policy-engine-2", "judge-engine-1", "judge-engine-2", "trainer"} <= names
    hosts = [urlparse(e["url"]).hostname for e in report["cluster"] if e["url"]]
    assert len(set(hosts)) == len(hosts) and all(ipaddress.ip_address(h).is_loopback for h in hosts)
    assert report["cluster_left_running"] == []

    # Every fault happened once; every weight update reached every live replica.
    assert sorted(f["fault"] for f in report["faults"]) == [
        "kill_judge_engine",
        "kill_judge_server",
        "kill_policy_replica",
        "restart_postgres",
    ]
    assert report["weight_updates"] and all(u["all_replicas_s"] is not None for u in report["weight_updates"])

    r, s = report["requests"], report["store"]
    assert r["served"] > 0 and set(r["by_kind"]) == {"chat", "responses", "messages", "openclaw"}
    assert r["unexplained"] == 0, [o for o in report["outcomes"] if o["cause"] == "unexplained"][:5]
    assert s["lost"] == 0 and s["recorded"] == s["answered"] == r["served"]
    assert s["unpaired"] == 0 and s["unjudged"] == 0
    assert s["leased_more_than_once"] == 0 and s["leased_exactly_once"] == s["leased_samples"] > 0
    assert s["at_least_one_violations"] == [] and s["closed_sessions"] > 0
    assert report["added_ms"]["n"] > 0
