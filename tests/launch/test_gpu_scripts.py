"""GPU launch scripts on CPU: syntax, --dry-run output for several GPU splits, and clear failures.

Contract (launch/*.sh, docs/LAUNCH.md): every script passes `bash -n`; `--dry-run` prints the exact
commands (one per process, env assignments first, `> log 2>&1 &`) and the readiness waits, creates
nothing and starts nothing; engine i of a pool gets the i-th group of tp GPU ids through
CUDA_VISIBLE_DEVICES; servers bind HOST (127.0.0.1 by default); a non-loopback HOST without API keys,
overlapping GPU sets, a split that does not fit NUM_GPUS, a list not divisible by tp, and an unknown
MODE all exit 2 with one "error: ..." line; API keys never appear in the printed commands.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.testkit.procs import process_gone
from tests.waiting import wait_until

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SCRIPTS = ["common.sh", "judge.sh", "policy.sh", "trainer.sh", "run.sh", "dev.sh"]
SECRET = "s3cr3t-key-value"


def dry_run(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``launch/<script> --dry-run`` with a clean, explicit environment."""
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HINDSIGHT_RUN_DIR": str(tmp_path / "run"),
        "HF_CKPT": "/models/policy",
    }
    return subprocess.run(
        ["bash", str(LAUNCH / script), "--dry-run"], env={**base, **env}, capture_output=True, text=True, timeout=30
    )


def commands(out: str) -> list[str]:
    return [line for line in out.splitlines() if line and not line.startswith("#")]


@pytest.mark.unit
@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script: str) -> None:
    res = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.unit
def test_run_default_split_is_trainer4_policy2_judge2(tmp_path: Path) -> None:
    res = dry_run("run.sh", tmp_path, MODE="combine")
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    assert len(cmds) == 7  # judge engine, judge router, judge, policy engine, policy router, policy, trainer
    prm, judge_router, judge, rollout, policy_router, policy, trainer = cmds
    assert prm.startswith(
        "CUDA_VISIBLE_DEVICES=6,7 python -m sglang.launch_server --model-path /models/policy --tp-size 2"
    )
    assert rollout.startswith("CUDA_VISIBLE_DEVICES=4,5 python -m sglang.launch_server")
    assert trainer.startswith(
        "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --standalone --nnodes 1 --nproc-per-node 4 -m trainer.cli"
    )
    assert "--worker-urls http://127.0.0.1:31100 " in judge_router
    assert judge.startswith("hindsight-judge --engine-url http://127.0.0.1:30201 --host 127.0.0.1 --port 30200")
    assert "--worker-urls http://127.0.0.1:31000 " in policy_router
    for flag in (
        "--engine-url http://127.0.0.1:30001",
        "--engine-worker-urls http://127.0.0.1:31000",
        "--judge-url http://127.0.0.1:30200",
        "--teacher-url http://127.0.0.1:30201",
        "--mode combine",
        f"--data-dir {tmp_path}/run/data",
    ):
        assert flag in policy, flag
    assert f"--out-dir {tmp_path}/run/checkpoints" in trainer
    assert "--policy-url http://127.0.0.1:30000" in trainer
    # Everything binds loopback by default, routers' metrics too.
    assert "0.0.0.0" not in res.stdout
    # Readiness: engines on /health, routers on /readiness (not /health), services on /ready.
    waits = [line for line in res.stdout.splitlines() if line.startswith("# wait")]
    assert [w.split()[3] for w in waits] == [
        "http://127.0.0.1:31100/health",
        "http://127.0.0.1:30201/readiness",
        "http://127.0.0.1:30200/ready",
        "http://127.0.0.1:31000/health",
        "http://127.0.0.1:30001/readiness",
        "http://127.0.0.1:30000/ready",
    ]
    assert not (tmp_path / "run").exists(), "a dry run must not create the run directory"


@pytest.mark.unit
def test_run_custom_split_four_judge_engines(tmp_path: Path) -> None:
    res = dry_run(
        "run.sh",
        tmp_path,
        NUM_GPUS="8",
        ACTOR_GPUS="0,1",
        ROLLOUT_GPUS="2,3",
        ROLLOUT_TP="1",
        PRM_GPUS="4,5,6,7",
        PRM_TP="1",
        PRM_MODEL_PATH="/models/judge",
    )
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    engines = [c for c in cmds if "sglang.launch_server" in c and "/models/judge" in c]
    assert [c.split()[0] for c in engines] == [f"CUDA_VISIBLE_DEVICES={g}" for g in (4, 5, 6, 7)]
    assert [c.split("--port ")[1].split()[0] for c in engines] == ["31100", "31101", "31102", "31103"]
    router = next(c for c in cmds if "launch_router" in c and "30201" in c)
    assert (
        "--worker-urls http://127.0.0.1:31100 http://127.0.0.1:31101 http://127.0.0.1:31102 http://127.0.0.1:31103 "
        in router
    )
    policy = next(c for c in cmds if c.startswith("hindsight-policy"))
    assert "--engine-worker-urls http://127.0.0.1:31000,http://127.0.0.1:31001" in policy
    assert " --mode " not in policy + " "  # MODE unset: the policy server's own default applies
    trainer = next(c for c in cmds if "torchrun" in c)
    assert trainer.startswith("CUDA_VISIBLE_DEVICES=0,1 torchrun") and "--nproc-per-node 2" in trainer


@pytest.mark.unit
def test_mode_as_argument_and_public_host_with_keys_redacted(tmp_path: Path) -> None:
    env = {
        "HOST": "0.0.0.0",
        "POLICY_API_KEY": SECRET,
        "POLICY_ADMIN_API_KEY": SECRET,
        "JUDGE_API_KEY": SECRET,
        "ENGINE_API_KEY": SECRET,
    }
    res = subprocess.run(
        ["bash", str(LAUNCH / "run.sh"), "--dry-run", "MODE=opd"],
        env={"PATH": os.environ["PATH"], "HINDSIGHT_RUN_DIR": str(tmp_path / "r"), "HF_CKPT": "/m", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert SECRET not in res.stdout + res.stderr
    policy = next(c for c in commands(res.stdout) if "hindsight-policy --model-path" in c)
    assert "--mode opd" in policy and "--host 0.0.0.0" in policy
    assert "HINDSIGHT_POLICY_API_KEY='***'" in policy  # keys go in the environment, not argv
    # Clients on the node still reach the servers through loopback.
    assert "--judge-url http://127.0.0.1:30200" in policy
    assert all("--api-key '***'" in c for c in commands(res.stdout) if "sglang" in c)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("run.sh", {"ACTOR_GPUS": "0,1,2,3,4"}, "GPU 4 is in both ACTOR_GPUS"),
        ("run.sh", {"NUM_GPUS": "4"}, "does not exist on a node with NUM_GPUS=4"),
        ("run.sh", {"PRM_GPUS": "6,7,8"}, "GPU 8 does not exist"),
        ("run.sh", {"ROLLOUT_GPUS": "4", "ROLLOUT_TP": "2"}, "not a multiple of the tp size 2"),
        ("run.sh", {"PRM_GPUS": "6,6"}, "lists GPU 6 twice"),
        ("run.sh", {"ACTOR_GPUS": "four"}, "is not a GPU id"),
        ("run.sh", {"MODE": "ppo"}, "MODE='ppo': use rl, opd or combine"),
        ("run.sh", {"HOST": "0.0.0.0"}, "is not loopback: set POLICY_ADMIN_API_KEY"),
        ("judge.sh", {"HOST": "10.0.0.5", "ENGINE_API_KEY": "k"}, "set JUDGE_API_KEY"),
        ("judge.sh", {"HF_CKPT": ""}, "PRM_MODEL_PATH (or HF_CKPT) is not set"),
        ("policy.sh", {"HOST": "0.0.0.0", "POLICY_ADMIN_API_KEY": "a"}, "set POLICY_API_KEY"),
        ("trainer.sh", {"TRAIN_STEPS": "0"}, "TRAIN_STEPS='0' must be a positive integer"),
    ],
)
def test_invalid_configuration_fails_clearly(tmp_path: Path, script: str, env: dict[str, str], message: str) -> None:
    res = dry_run(script, tmp_path, **env)
    assert res.returncode == 2
    assert res.stdout == "", "nothing may be printed as a command before validation passes"
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], res.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    ("script", "first"),
    [
        ("judge.sh", "CUDA_VISIBLE_DEVICES=0,1 python -m sglang.launch_server"),
        ("policy.sh", "CUDA_VISIBLE_DEVICES=0,1 python -m sglang.launch_server"),
        ("trainer.sh", "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun"),
    ],
)
def test_standalone_scripts_dry_run(tmp_path: Path, script: str, first: str) -> None:
    res = dry_run(script, tmp_path, SGLANG_PYTHON="python", PYTHON="python")
    assert res.returncode == 0, res.stderr
    assert commands(res.stdout)[0].startswith(first)


@pytest.mark.unit
def test_unknown_argument_and_help(tmp_path: Path) -> None:
    res = subprocess.run(
        ["bash", str(LAUNCH / "run.sh"), "--frobnicate"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HF_CKPT": "/m"},
        timeout=30,
    )
    assert res.returncode == 2 and "unknown argument '--frobnicate'" in res.stderr
    res = subprocess.run(["bash", str(LAUNCH / "run.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "MODE=rl|opd|combine" in res.stdout


@pytest.mark.unit
def test_a_process_that_dies_fails_the_wait_fast(tmp_path: Path) -> None:
    """An engine that exits at once ends the script within seconds (not after its readiness deadline)."""
    run_dir = tmp_path / "run"
    res = subprocess.run(
        ["bash", str(LAUNCH / "judge.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": os.environ["PATH"],
            "HINDSIGHT_RUN_DIR": str(run_dir),
            "HF_CKPT": "/m",
            "SGLANG_PYTHON": "false",
            "ENGINE_READY_TIMEOUT_S": "600",
            "PRM_TP": "1",
        },
    )
    assert res.returncode == 2, res.stderr
    assert "error: prm-engine-0 not ready" in res.stderr and "exited before" in res.stderr
    assert (run_dir / "logs" / "prm-engine-0.log").exists()
    assert (run_dir / "commands.log").read_text().count("sglang.launch_server") == 2
    assert list((run_dir / "pids").glob("*.pid")) == [], "the trap removes the PID files of what it stopped"


@pytest.mark.unit
def test_policy_replicas_share_the_store_url(tmp_path: Path) -> None:
    url = "postgresql://hs:" + SECRET + "@db.internal:5432/hindsight"
    res = dry_run("policy.sh", tmp_path, POLICY_REPLICAS="3", STORE_URL=url)
    assert res.returncode == 0, res.stderr
    policies = [c for c in commands(res.stdout) if "hindsight-policy --model-path" in c]
    assert [c.split("--port ")[1].split()[0] for c in policies] == ["30000", "30010", "30020"]
    assert [c.split("--replica-id ")[1].split()[0] for c in policies] == ["policy", "policy-1", "policy-2"]
    assert all(c.startswith("HINDSIGHT_POLICY_STORE_URL='***' ") for c in policies)
    assert SECRET not in res.stdout  # the store URL's password is never printed
    res = dry_run("policy.sh", tmp_path, POLICY_REPLICAS="2")
    assert res.returncode == 2 and "needs STORE_URL=postgresql://" in res.stderr
    res = dry_run("policy.sh", tmp_path, POLICY_REPLICAS="2", STORE_URL=url, POLICY_REPLICA_PORT_STEP="1")
    assert res.returncode == 2 and "taken by another service" in res.stderr


# A script built from common.sh the way judge.sh is: one process, optionally a readiness wait that never
# succeeds (port 9 refuses, the deadline is far away), then the foreground supervision.
HARNESS = r"""
set -euo pipefail
source "$1/common.sh"
HS_RUN_DIR=$2
hs_prepare_run_dir
hs_install_trap
hs_spawn sleeper -- sleep 600
if [[ $3 == wait ]]; then hs_wait_http sleeper "http://127.0.0.1:9/health" 600; fi
hs_supervise
"""


def _start_harness(tmp_path: Path, phase: str, **env: str) -> tuple[subprocess.Popen[str], int]:
    """The harness in its own session with stderr on a pipe, once it has logged ``phase``; (script, sleeper PID)."""
    run_dir = tmp_path / "run"
    script = subprocess.Popen(
        ["bash", "-c", HARNESS, "harness", str(LAUNCH), str(run_dir), "wait" if phase == "started" else "-"],
        env={"PATH": os.environ["PATH"], "PYTHON": sys.executable, "HS_STOP_GRACE_S": "10", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert script.stderr is not None
    for line in script.stderr:
        if phase in line:
            break
    else:
        pytest.fail(f"the harness exited ({script.wait()}) before logging {phase!r}")
    return script, int((run_dir / "pids" / "sleeper.pid").read_text())


def _kill_harness(script: subprocess.Popen[str], sleeper: int) -> None:
    """Whatever a test left running of the harness and its sleeper, gone (both lead process groups)."""
    for pid in (script.pid, sleeper):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.unit
def test_a_stop_with_nobody_reading_the_log_still_stops_everything(tmp_path: Path) -> None:
    """The terminal or pipe the script logs to is gone (an ssh session dropped): the stop's first log line
    must not kill the script before it has stopped what it started."""
    script, sleeper = _start_harness(tmp_path, "all up")
    try:
        assert script.stderr is not None
        script.stderr.close()
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=30) == 143
        wait_until(lambda: process_gone(sleeper), timeout_s=15, message=f"sleeper {sleeper} outlived the script")
        assert list((tmp_path / "run" / "pids").glob("*.pid")) == []
    finally:
        _kill_harness(script, sleeper)


@pytest.mark.unit
def test_a_stop_during_a_readiness_wait_is_handled_at_once(tmp_path: Path) -> None:
    """SIGTERM while the script waits for a server (deadline 600 s) stops it and its processes within seconds."""
    script, sleeper = _start_harness(tmp_path, "started")
    try:
        time.sleep(0.5)  # the readiness poller is running
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=30) == 143
        assert script.stderr is not None and "stopping sleeper" in script.stderr.read()
        wait_until(lambda: process_gone(sleeper), timeout_s=15, message=f"sleeper {sleeper} outlived the script")
    finally:
        _kill_harness(script, sleeper)


@pytest.mark.unit
def test_the_supervision_wakes_up_and_ends_only_when_a_process_exits(tmp_path: Path) -> None:
    """The foreground supervision wakes every HS_WAKE_S (a stop signal bash held back as a wait began is handled
    then) without ending: it ends when a started process exits, with that process's status, and cleans up."""
    script, sleeper = _start_harness(tmp_path, "all up", HS_WAKE_S="0.05")
    try:
        time.sleep(1.0)  # about twenty wake-ups
        assert script.poll() is None, "a wake-up ended the supervision"
        assert not process_gone(sleeper)
        os.kill(sleeper, signal.SIGUSR1)  # sleep dies of it: status 128 + 10, not the trap's 143
        assert script.wait(timeout=30) == 138
        assert script.stderr is not None and f"sleeper (pid {sleeper}) exited with 138" in script.stderr.read()
        assert list((tmp_path / "run" / "pids").glob("*.pid")) == []
    finally:
        _kill_harness(script, sleeper)


@pytest.mark.unit
def test_hs_wait_any_returns_the_status_of_the_first_process_to_exit() -> None:
    """Across many wake-ups, hs_wait_any returns once one of its processes exits, with that one's status."""
    body = r"""
set -euo pipefail
source "$1/common.sh"
HS_WAKE_S=0.05
(sleep 0.6; exit 7) &
first=$!
sleep 30 &
other=$!
rc=0
hs_wait_any "$first" "$other" || rc=$?
kill -0 "$other" && echo "other still running"
kill "$other"
echo "rc=$rc ticker=${HS_TICKER:-none}"
"""
    res = subprocess.run(["bash", "-c", body, "t", str(LAUNCH)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["other still running", "rc=7 ticker=none"]


@pytest.mark.unit
def test_hs_wait_any_sees_a_process_that_ends_between_two_waits() -> None:
    """A process that ends while no ``wait -n`` runs (between two wake-ups) can be reaped by bash and dropped from
    its job table; hs_wait_any still returns its status within a wake-up. Many short wake-ups and kills at random
    moments: before the per-wake-up look, about 4 % of such waits never returned."""
    body = r"""
set -euo pipefail
source "$1/common.sh"
HS_WAKE_S=0.003
for i in $(seq 1 60); do
  sleep 600 &
  s=$!
  ( sleep "0.0$((RANDOM % 10))"; kill -USR1 "$s" ) &
  rc=0
  hs_wait_any "$s" || rc=$?
  wait
  echo "$rc"
done
"""
    res = subprocess.run(["bash", "-c", body, "t", str(LAUNCH)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["138"] * 60
