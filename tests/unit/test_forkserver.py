"""The test kit's fork server (tests.testkit.forkserver): a forked child is the process a fresh interpreter
would be (argv, working directory, sys.path, environment, session, output, exit status), and only commands that
cannot tell the difference qualify."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.procs import child_env
from tests.testkit import forkserver

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux-only (prctl)")

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    if sys.argv[1:2] == ["sleep"]:
        print("sleeping", flush=True)
        time.sleep(600)
    print(json.dumps({
        "name": __name__,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path": sys.path,
        "env": dict(os.environ),
        "leads_session": os.getsid(0) == os.getpid(),
    }))
    sys.stderr.write("to stderr\\n")
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> forkserver._Client:
    """This process's fork server, the one every service start of the suite goes through (started here when no
    test before started one: a fork server imports torch and transformers, about 5 CPU-seconds)."""
    if not forkserver.enabled():
        pytest.skip("HINDSIGHT_TEST_FORK_SERVER=0")
    c = forkserver._get_client(tmp_path_factory.mktemp("forkserver"))
    if c is None:
        pytest.fail("no fork server could be started (see its log)")
    return c


def _probe(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    pkg = tmp_path / "pp"
    pkg.mkdir()
    (pkg / "hs_probe.py").write_text(PROBE)
    wd = tmp_path / "wd"
    wd.mkdir()
    env = {**child_env(), "PYTHONPATH": str(pkg), "HINDSIGHT_PROBE": "yes"}
    env.pop("NO_COLOR")  # set in the fork server's own environment: the child must not keep it
    return pkg, wd, env


def test_a_forked_child_is_what_a_fresh_interpreter_would_be(
    client: forkserver._Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, wd, env = _probe(tmp_path)
    cmd = [sys.executable, "-m", "hs_probe", "3", "--flag"]
    fresh = subprocess.run(cmd, cwd=wd, env=env, capture_output=True, text=True, timeout=60)
    monkeypatch.chdir(wd)  # the fork server runs the child in the caller's working directory
    log = tmp_path / "forked.log"
    proc = client.fork(cmd, log, env)
    assert proc.wait(timeout=60) == 3 == fresh.returncode
    out, err_line = log.read_text().splitlines()
    forked = json.loads(out)
    assert forked.pop("leads_session") is True  # a session (process group) of its own, as spawn asks
    expected = json.loads(fresh.stdout)
    expected.pop("leads_session")
    assert forked == expected  # __main__, argv, cwd, the whole sys.path and the exact environment
    assert err_line == "to stderr"  # stderr goes to the same log


def test_a_forked_child_runs_the_torch_threads_a_fresh_one_would(
    client: forkserver._Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg, wd, env = _probe(tmp_path)
    (pkg / "hs_threads.py").write_text(
        "import torch\nprint(torch.get_num_threads(), torch.get_num_interop_threads())\n"
    )
    monkeypatch.chdir(wd)
    for threads in ("1", "2"):
        env = {**env, "OMP_NUM_THREADS": threads}
        cmd = [sys.executable, "-m", "hs_threads"]
        fresh = subprocess.run(cmd, cwd=wd, env=env, capture_output=True, text=True, timeout=120)
        log = tmp_path / f"threads-{threads}.log"
        assert client.fork(cmd, log, env).wait(timeout=60) == 0 == fresh.returncode
        assert log.read_text() == fresh.stdout and fresh.stdout.split()[0] == threads


def test_a_service_cli_forked_writes_what_a_fresh_one_writes(
    client: forkserver._Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # its modules are already imported in the fork server: the child must still run as `python -m` runs it
    # (no runpy warning about a module found in sys.modules, the same usage text)
    cmd = [sys.executable, "-m", "judge_server.cli", "--help"]
    fresh = subprocess.run(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120
    )
    log = tmp_path / "judge-help.log"
    proc = client.fork(cmd, log, child_env())
    assert proc.wait(timeout=60) == 0 == fresh.returncode
    assert log.read_text() == fresh.stdout and "usage" in fresh.stdout


def test_signals_waits_and_a_timeout_read_as_with_popen(
    client: forkserver._Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, wd, env = _probe(tmp_path)
    monkeypatch.chdir(wd)
    log = tmp_path / "sleeper.log"
    proc = client.fork([sys.executable, "-m", "hs_probe", "sleep"], log, env)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None and proc.returncode is None
    os.killpg(proc.pid, signal.SIGTERM)  # what ManagedProcess.stop sends: the child leads its group
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.kill()  # a no-op once reaped: never a signal to a PID that may have been reused


@pytest.mark.unit
def test_only_commands_that_cannot_tell_the_difference_qualify() -> None:
    base = {"PATH": "/usr/bin", "HF_HUB_OFFLINE": "1"}
    py = sys.executable
    judge = [py, "-m", "judge_server.cli", "--port", "1"]
    assert forkserver.qualifies(judge, base, base)
    assert forkserver.qualifies(judge, {**base, "HINDSIGHT_JUDGE_M": "3", "PYTHONPATH": "/x"}, base)
    assert forkserver.qualifies(judge, {**base, "PYTEST_CURRENT_TEST": "t.py::b (setup)"}, base)  # per test
    # torch sets its compile cache in this process when it first compiles, and reads it only when compiling
    assert forkserver.qualifies(judge, {**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_x"}, base)
    # read by libraries when they are imported: needs a fresh interpreter
    # a thread count is applied in the child (torch.set_num_threads), as the runtime would read it at load
    assert forkserver.qualifies(judge, {**base, "OMP_NUM_THREADS": "1"}, base)
    assert not forkserver.qualifies(judge, base, {**base, "OMP_NUM_THREADS": "1"})  # unset again: the default
    assert not forkserver.qualifies(judge, {**base, "OMP_NUM_THREADS": "1,1"}, base)  # nested: not applied
    assert not forkserver.qualifies(judge, {**base, "MALLOC_ARENA_MAX": "2"}, base)  # read when libc starts
    assert not forkserver.qualifies(judge, {"PATH": "/usr/bin"}, base)  # a variable removed counts too
    assert not forkserver.qualifies([py, "-m", "http.server"], base, base)  # not preloaded
    assert not forkserver.qualifies(["/usr/bin/python3", "-m", "judge_server.cli"], base, base)
    assert not forkserver.qualifies([py, "-c", "judge_server.cli"], base, base)


def test_the_fork_server_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HINDSIGHT_TEST_FORK_SERVER", "0")
    proc = forkserver.launch(
        [sys.executable, "-m", "judge_server.cli", "--help"], log_path=tmp_path / "l", env=child_env()
    )
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=60) == 0


def test_a_variable_set_in_this_process_later_gets_a_fork_server_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if not forkserver.enabled():
        pytest.skip("HINDSIGHT_TEST_FORK_SERVER=0")
    cmd = [sys.executable, "-m", "judge_server.cli", "--help"]
    first = forkserver.launch(cmd, log_path=tmp_path / "a.log", env=child_env())
    assert isinstance(first, forkserver.ForkedProcess) and first.wait(timeout=60) == 0
    servers = len(forkserver._clients)
    # as torch sets TORCHINDUCTOR_CACHE_DIR in its own process: a fresh child would inherit it, so must a forked one
    monkeypatch.setenv("HS_TEST_SET_BY_A_LIBRARY", "1")
    try:
        second = forkserver.launch(cmd, log_path=tmp_path / "b.log", env=child_env())
        assert isinstance(second, forkserver.ForkedProcess) and second.wait(timeout=60) == 0
        assert len(forkserver._clients) == servers + 1
        assert forkserver._clients[-1].env["HS_TEST_SET_BY_A_LIBRARY"] == "1"
        assert first.returncode == 0  # the earlier fork server still answers for its children
    finally:
        # The variable goes with this test: the fork server started for it would only make the next service start
        # of this worker start a third one. Its one child has exited.
        if len(forkserver._clients) > servers:
            extra = forkserver._clients.pop()
            extra.proc.kill()
            extra.proc.wait()
