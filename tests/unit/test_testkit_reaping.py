"""The test kit ties every server to the process that started it: ``kill -9`` of that process (pytest, a
bench) kills the server too, so an interrupted run leaves nothing running.

A stand-in for pytest (a Python process that imports the test kit) starts a server through
``tests.testkit.procs.spawn`` from a short-lived thread, as a fixture in a pool might, reports its PID and
waits; the test SIGKILLs the stand-in and checks that the server is gone, both for a command started as a
fresh process and for a service CLI forked from the test kit's fork server (a grandchild of the stand-in).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.testkit.procs import process_gone
from tests.testkit.servers import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")

PARENT = """
import sys, threading, time
from pathlib import Path
from tests.testkit.procs import free_port, spawn

def start():
    if sys.argv[2] == "forked":  # a service CLI: forked from the test kit's fork server
        server = [sys.executable, "-m", "judge_server.cli", "--host", "127.0.0.1", "--port", str(free_port())]
    else:
        server = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"]
    mp = spawn("server", server, url="", log_dir=Path(sys.argv[1]))
    print(mp.pid, type(mp.proc).__name__, flush=True)

thread = threading.Thread(target=start)
thread.start()
thread.join()  # the starting thread is gone: the server must outlive it, not the process
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("how", "handle"), [("exec", "Popen"), ("forked", "ForkedProcess")])
def test_sigkill_of_the_starting_process_kills_its_servers(tmp_path: Path, how: str, handle: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("HINDSIGHT_TEST_FORK_SERVER", None)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), how], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    server_pid = None
    try:
        assert parent.stdout is not None
        pid, started_as = parent.stdout.readline().split()
        server_pid = int(pid)
        assert started_as == handle  # a service CLI through the fork server (its child), anything else exec'd
        assert parent.stdout.readline().strip() == "ready"
        assert not process_gone(server_pid)  # it survived the end of the thread that started it
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30  # the kernel's signal is immediate; the bound only ends a failure
        while not process_gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(server_pid), f"server {server_pid} outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if server_pid is not None and not process_gone(server_pid):
            os.killpg(server_pid, signal.SIGKILL)  # its own group: only what this test started
