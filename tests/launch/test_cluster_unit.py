"""launch/cluster.py's pure parts: every "host" on its own loopback address, HAProxy's configuration (both
backends round robin with a ``/ready`` check on every server, frontends on the load balancer's address only) and
the script's usage. The live start/stop (every part ready, stop leaves nothing) is tests/launch/test_soak.py."""

from __future__ import annotations

import ipaddress
import subprocess
import time
from pathlib import Path

import pytest

from launch import cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def test_every_host_has_its_own_loopback_address() -> None:
    addrs = list(cluster.HOSTS.values())
    assert len(set(addrs)) == len(addrs)
    assert all(ipaddress.ip_address(a).is_loopback and a != "127.0.0.1" for a in addrs)
    assert len(cluster.POLICY_REPLICAS) == 3 and len(cluster.JUDGE_SERVERS) == 2 and cluster.TRAINER_RANKS == 2


def test_haproxy_config_checks_ready_on_every_server() -> None:
    policy = ["http://127.0.0.13:1001", "http://127.0.0.14:1002", "http://127.0.0.15:1003"]
    judge = ["http://127.0.0.16:2001", "http://127.0.0.17:2002"]
    cfg = cluster.haproxy_config(policy, judge, 3000, 3001, 3002)
    lb = cluster.HOSTS["lb"]
    assert f"bind {lb}:3000" in cfg and f"bind {lb}:3001" in cfg and f"bind {lb}:3002" in cfg
    assert cfg.count("option httpchk GET /ready") == 2 and cfg.count("balance roundrobin") == 2
    for url in policy + judge:
        assert f"{url.removeprefix('http://')} check" in cfg
    assert "bind *" not in cfg and "0.0.0.0" not in cfg


def test_script_usage_and_refusals() -> None:
    out = subprocess.run([ROOT / "launch/cluster.sh", "--help"], capture_output=True, text=True, check=True).stdout
    assert "127.0.0.11" in out and "stop" in out
    bad = subprocess.run([ROOT / "launch/cluster.sh", "restart"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2


def test_a_zombie_is_not_running() -> None:
    """A process that exited but was not reaped (a container's PID 1 may reap nothing) is not ours to stop."""
    import signal

    from launch import devstack

    child = subprocess.Popen(["sleep", "30"])
    entry = {"pid": child.pid, "start_ticks": devstack.proc_start_ticks(child.pid)}
    try:
        assert devstack.is_ours(entry)
        child.send_signal(signal.SIGKILL)
        for _ in range(100):  # not waited for: a zombie until the wait below
            if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.02)
        assert devstack.proc_start_ticks(child.pid) == entry["start_ticks"]
        assert not devstack.is_ours(entry)
    finally:
        child.kill()
        child.wait()
