"""The CPU dev stack end to end: `launch/dev.sh start`, `demo`, `stop`, and nothing left running.

Contract (launch/devstack.py, launch/demo.py): `start` returns once every part answers on 127.0.0.1 and
writes endpoints.json (policy_url, judge_url, policy_engine_url, api_key, admin_api_key, ...); a second
`start` changes nothing; the policy server refuses a request without the key; `demo` drives a session
with a tool call through the openai client, shows judge verdicts and stored samples, trains one step
and reports the engine's new weight version, then writes the run report (every plot renders in headless
Chromium); after the demo, every metric series the Grafana dashboard queries is exported by one of the stack's
services; `stop` ends every recorded PID and frees every port, and
never signals a process whose PID was recycled (start time differs).
This stack runs the default judge backend; tests/agents/test_openclaw_e2e.py starts its stack with
`JUDGE_BACKEND=openai` and asserts its judged turn went through the judge router's /v1/chat/completions.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from launch import devstack
from tests.launch.dashboard_check import missing_dashboard_metrics
from tests.testkit.chromium import check_rendered, require_chromium
from tests.testkit.procs import dev_sh as dev

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / "launch" / "dev.sh"


def port_open(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((u.hostname, u.port)) == 0


@pytest.fixture(scope="module")
def stack_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, teacher_model_dir: Path):
    """A run dir with the session's tiny models in place (dev.sh builds them only when missing)."""
    run_dir = tmp_path_factory.mktemp("devstack")
    shutil.copytree(tiny_model_dir, run_dir / "models" / "policy")
    shutil.copytree(teacher_model_dir, run_dir / "models" / "teacher")
    # The dev stack's models hold DEV_CONTEXT_TOKENS (rotary positions: no weight depends on it), else it rebuilds them.
    from launch.devstack import DEV_CONTEXT_TOKENS

    for name in ("policy", "teacher"):
        cfg_path = run_dir / "models" / name / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps({**cfg, "max_position_embeddings": DEV_CONTEXT_TOKENS}))
    yield run_dir
    if (run_dir / "pids.json").exists():  # a failed test must not leave the stack running
        dev("stop", run_dir, 60)


@pytest.mark.e2e
@pytest.mark.slow
def test_dev_stack_start_demo_stop(stack_dir: Path) -> None:
    res = dev("start", stack_dir, 240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "building" not in res.stdout  # the prebuilt models were reused
    endpoints = json.loads((stack_dir / "endpoints.json").read_text())
    for key in ("policy_url", "judge_url", "policy_engine_url", "api_key", "admin_api_key"):
        assert endpoints[key], key
    assert endpoints["mode"] == "rl" and endpoints["judge_backend"] == "llm"
    entries = devstack.read_pids(stack_dir)
    assert [e["name"] for e in entries] == [
        "watchdog",  # tied to this test process (tests.testkit.procs.dev_sh)
        "policy-engine",
        "policy-router",
        "judge-engine",
        "judge-router",
        "judge",
        "policy",
    ]
    assert all(devstack.is_ours(e) for e in entries)
    assert all(urlparse(e["url"]).hostname == "127.0.0.1" for e in entries[1:])
    # Logs can hold prompts: the owner's only.
    assert stat.S_IMODE((stack_dir / "logs").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(Path(e["log"]).stat().st_mode) == 0o600 for e in entries)

    again = dev("start", stack_dir, 60)
    assert again.returncode == 0 and "already running" in again.stdout
    assert devstack.read_pids(stack_dir) == entries

    with httpx.Client(trust_env=False, timeout=10) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert c.post(endpoints["policy_url"] + "/v1/chat/completions", json=body).status_code == 401
        assert c.get(
            endpoints["policy_url"] + "/v1/samples/stats", headers={"Authorization": f"Bearer {endpoints['api_key']}"}
        ).status_code in (401, 403)

    demo = dev("demo", stack_dir, 300)
    out = demo.stdout
    assert demo.returncode == 0, out + demo.stderr
    assert "judge backend: llm" in out
    assert re.search(r"tool call get_weather\(\{\"city\": ", out), out
    verdicts = re.findall(r"turn (\d): PRM votes \[([-01, ]+)\] -> score (-?\d|None)", out)
    assert len(verdicts) >= 3, out  # every turn with a next state was judged with votes
    assert "turn 3: no PRM verdict  [rejected: no_next_state]" in out
    assert re.search(r"trained step 1 in", out), out
    assert "policy engine weight version: default -> 1" in out
    assert "a new request is served by weights v1" in out
    report = re.search(r"report: (\S+\.html)", out)
    assert report and Path(report.group(1)).is_file(), out
    # Every series the Grafana dashboard queries is exported by some service of the stack the demo just drove.
    assert missing_dashboard_metrics(endpoints) == [], "dashboard queries metrics no dev-stack service exports"

    stop = dev("stop", stack_dir, 90)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{e['pid']}").exists() for e in entries):
        time.sleep(0.1)
    for e in entries:
        assert devstack.proc_start_ticks(e["pid"]) != e["start_ticks"], f"{e['name']} still running"
        assert not e["url"] or not port_open(e["url"]), f"{e['name']} still listens on {e['url']}"
    assert not (stack_dir / "pids.json").exists() and not (stack_dir / "endpoints.json").exists()
    assert "no dev stack recorded" in dev("stop", stack_dir, 30).stdout

    # The demo's run report, opened in headless Chromium: every plot rendered, those with data have marks.
    require_chromium()
    check_rendered(
        Path(report.group(1)),
        (
            "verdicts_per_version",
            "samples_per_mode",
            "samples_per_status",
            "judge_votes_per_turn",
            "ppo_loss",
            "trainer_throughput",
        ),
    )


@pytest.mark.unit
def test_stop_never_signals_a_recycled_pid(tmp_path: Path) -> None:
    victim = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        ticks = devstack.proc_start_ticks(victim.pid)
        assert ticks is not None
        devstack.write_json(
            tmp_path / "pids.json",
            [
                {"name": "recycled", "pid": victim.pid, "start_ticks": ticks + 1, "url": "", "log": ""},
                {"name": "gone", "pid": 2**22 + 7, "start_ticks": 1, "url": "", "log": ""},
            ],
        )
        res = dev("stop", tmp_path, 30)
        assert res.returncode == 0, res.stderr
        assert "nothing (all had already exited)" in res.stdout
        assert victim.poll() is None, "a process that is not ours was signalled"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.unit
def test_dev_sh_rejects_bad_input(tmp_path: Path) -> None:
    res = dev("start", tmp_path, 30, MODE="ppo")
    assert res.returncode == 2 and "MODE='ppo': use rl, opd or combine" in res.stderr
    res = dev("start", tmp_path, 30, JUDGE_BACKEND="gpt")
    assert res.returncode == 2 and "JUDGE_BACKEND='gpt'" in res.stderr
    res = dev("frobnicate", tmp_path, 30)
    assert res.returncode == 2 and "launch/dev.sh start" in res.stderr
    assert not (tmp_path / "pids.json").exists()


@pytest.mark.unit
def test_the_watchdog_stops_the_stack_when_its_owner_dies(tmp_path: Path) -> None:
    """A stack started with HINDSIGHT_DEV_STOP_WITH_PID is stopped when that process dies, even by SIGKILL."""
    owner = subprocess.Popen(["sleep", "600"])
    service = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        stack = devstack.Stack(tmp_path)
        watchdog = devstack.start_watchdog(stack, owner.pid)
        ticks = devstack.proc_start_ticks(service.pid)
        stack.entries.append({"name": "service", "pid": service.pid, "start_ticks": ticks, "url": "", "log": ""})
        devstack.write_json(tmp_path / "pids.json", stack.entries)
        time.sleep(2 * devstack.WATCH_INTERVAL_S)
        assert service.poll() is None  # the owner lives: nothing is stopped
        owner.kill()
        owner.wait()
        service.wait(timeout=30)  # the watchdog stopped it
        assert watchdog.proc.wait(timeout=10) == 0  # and then ended itself, the stack's files removed
        assert not (tmp_path / "pids.json").exists()
    finally:
        for p in (owner, service):
            p.kill()
            p.wait()
