"""launch/judge.sh for real on the CPU: SGLang replaced by the dev engine, everything else real.

Contract (launch/common.sh): engines are pinned with CUDA_VISIBLE_DEVICES (one tp group each) and
waited on, the real sglang-router is waited on /readiness, hindsight-judge on /ready; the script stays in
the foreground; on Ctrl-C (SIGINT) it stops exactly the process groups it started, leaves no PID
file and no listening port behind, and exits 130. `SGLANG_PYTHON` is the seam: here a shim that
translates `-m sglang.launch_server ...` into `-m devkit.dev_server.cli ...` (flags the dev engine
does not have, like --tp-size, are dropped and recorded).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.testkit.procs import free_port, http_client, process_gone
from tests.testkit.servers import prm_pair

ROOT = Path(__file__).resolve().parents[2]

SHIM = """#!{python}
import json, os, sys
args = sys.argv[1:]
assert args[:2] == ["-m", "sglang.launch_server"], args
flags = dict(zip(args[2::2], args[3::2]))
with open(os.environ["FAKE_SGLANG_RECORD"], "a") as fh:
    fh.write(json.dumps({{"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "flags": flags}}) + "\\n")
keep = ["--model-path", "--host", "--port", "--served-model-name", "--api-key"]
argv = [sys.executable, "-m", "devkit.dev_server.cli", "--torch-threads", "1"]
for k in keep:
    if k in flags:
        argv += [k, flags[k]]
os.execv(sys.executable, argv)
"""


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_judge_sh_starts_waits_and_stops_only_its_processes(tmp_path: Path, tiny_model_dir: Path) -> None:
    shim = tmp_path / "fake-sglang-python"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    record = tmp_path / "engines.jsonl"
    run_dir = tmp_path / "run"
    ports = {
        "JUDGE_ENGINE_BASE_PORT": free_port(),
        "JUDGE_ROUTER_PORT": free_port(),
        "JUDGE_ROUTER_METRICS_PORT": free_port(),
        "JUDGE_PORT": free_port(),
    }
    if ports["JUDGE_ENGINE_BASE_PORT"] + 1 in ports.values():
        pytest.skip("ephemeral ports collided with the engine port range; rerun")
    env = {
        **os.environ,
        "HINDSIGHT_RUN_DIR": str(run_dir),
        "PRM_MODEL_PATH": str(tiny_model_dir),
        "NUM_GPUS": "2",
        "PRM_GPUS": "0,1",
        "PRM_TP": "1",
        "SGLANG_PYTHON": str(shim),
        "ROUTER_PYTHON": sys.executable,
        "PYTHON": sys.executable,
        "HINDSIGHT_JUDGE_BIN": str(Path(sys.executable).parent / "hindsight-judge"),
        "FAKE_SGLANG_RECORD": str(record),
        "ENGINE_READY_TIMEOUT_S": "120",
        "HS_STOP_GRACE_S": "10",
        **{k: str(v) for k, v in ports.items()},
    }
    script = subprocess.Popen(
        ["bash", str(ROOT / "launch" / "judge.sh")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_signals_as_at_a_terminal,
    )
    pids: dict[str, int] = {}
    try:
        judge_url = f"http://127.0.0.1:{ports['JUDGE_PORT']}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and script.poll() is None:
            if _ready(judge_url):
                break
            time.sleep(0.5)
        assert script.poll() is None, script.stdout.read()
        # Every process is recorded before it is waited on.
        pids = {p.stem: int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")}
        assert set(pids) == {"prm-engine-0", "prm-engine-1", "judge-router", "judge"}
        engines = [json.loads(line) for line in record.read_text().splitlines()]
        assert sorted((e["cuda"], e["flags"]["--port"]) for e in engines) == [
            ("0", str(ports["JUDGE_ENGINE_BASE_PORT"])),
            ("1", str(ports["JUDGE_ENGINE_BASE_PORT"] + 1)),
        ]
        assert all(e["flags"]["--tp-size"] == "1" and e["flags"]["--host"] == "127.0.0.1" for e in engines)
        with httpx.Client(trust_env=False, timeout=60) as c:
            workers = c.get(f"http://127.0.0.1:{ports['JUDGE_ROUTER_PORT']}/readiness").json()
            assert workers["healthy_workers"] == 2
            verdict = c.post(judge_url + "/v1/judge", json=prm_pair()).json()
        assert verdict["prm"]["status"] in ("ok", "tie", "no_valid_votes")  # the engine path answered

        script.send_signal(signal.SIGINT)  # the operator's Ctrl-C reaches the script only (own sessions)
        out, _ = script.communicate(timeout=60)
        assert script.returncode == 130, out
        assert "stopping" in out
        for name, pid in pids.items():
            assert process_gone(pid), f"{name} ({pid}) still running"
        for k in ("JUDGE_ENGINE_BASE_PORT", "JUDGE_ROUTER_PORT", "JUDGE_PORT"):
            assert not port_open(ports[k]), k
        assert not port_open(ports["JUDGE_ENGINE_BASE_PORT"] + 1)
        assert list((run_dir / "pids").glob("*.pid")) == []
    finally:
        if script.poll() is None:  # the script's TERM trap stops what it started; SIGKILL if even that hangs
            os.killpg(script.pid, signal.SIGTERM)
            try:
                script.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(script.pid, signal.SIGKILL)
                script.wait(timeout=10)
        for pid in pids.values():  # only the groups this test's script started, if it left any
            if process_gone(pid):
                continue
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _signals_as_at_a_terminal() -> None:
    """Ctrl-C and Ctrl-\\ with their default actions, as in a terminal's foreground job: a run started in the
    background (``pytest ... &``) passes them on ignored, and a non-interactive bash cannot trap a signal it
    was started with ignored, so the script's INT trap would never run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _ready(url: str) -> bool:
    try:
        with http_client(timeout=2) as c:
            return c.get(url + "/ready").status_code == 200
    except httpx.HTTPError:
        return False
