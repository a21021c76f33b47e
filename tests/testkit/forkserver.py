"""A fork server for the test kit: the services' own CLIs started by ``fork`` from a process that has already
imported them, instead of a fresh interpreter each time.

Why: a fresh dev engine spends about 5.5 CPU-seconds importing torch and transformers before it serves, a
policy server about 4.3; the suite starts some 130 of them, about a third of its CPU on a 2-core machine. A
child forked from a process with those modules loaded is serving in about 0.2 s. What runs is unchanged: the
child runs ``python -m MODULE ARGS`` (``runpy``, as ``-m`` does) with exactly the requested environment, working
directory and ``sys.path``, in a new session, its output appended to the log, and it exits through the
interpreter's normal shutdown, with the exit status or signal a fresh process would have.

Contract (:func:`launch`, an ``engine.procs.Launcher``): a command is forked only when it is
``sys.executable -m M`` for a module in :data:`PRELOADED` and its environment differs from the fork server's only
in ``HINDSIGHT_*`` and ``PYTEST_*`` variables, ``PYTHONPATH``, ``TORCHINDUCTOR_CACHE_DIR`` and a thread count
``OMP_NUM_THREADS`` that the child applies to torch (anything else, ``MALLOC_ARENA_MAX`` say, can be read when a
library is imported, so it needs a fresh interpreter); every other command, or every command when
``HINDSIGHT_TEST_FORK_SERVER=0``, is started by ``engine.procs.popen_launch``. The fork server is tied to the
process that started it (parent-death signal) and each child to the fork server, so ``kill -9`` of pytest still
ends every server. One fork server per process, started on first use; a new one when this process's own
environment has since changed (a library set a variable), so a child never misses what a fresh one would inherit.
``HINDSIGHT_TEST_FORK_SERVER_TRACE=FILE`` writes one line per service start: forked or fresh, and why.
"""

from __future__ import annotations

import json
import os
import queue
import runpy
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from engine import procs as _procs

# Started by fork when asked (the services' CLIs, and torchrun, whose ranks start fresh or are forked by torchrun
# itself: tests.testkit.trainer_cli). The fork server imports what they import on start-up, never these modules
# themselves: `python -m` runs a module that nothing imported before (runpy warns otherwise).
PRELOADED = ("devkit.dev_server.cli", "policy_server.cli", "judge_server.cli", "trainer.cli", "torch.distributed.run")
_IMPORTED_BY_STARTUP = (
    "uvicorn",
    "engine.cli_settings",
    "engine.observability",
    "devkit.dev_server.app",
    "devkit.dev_server.settings",
    "transformers.models.qwen3.modeling_qwen3",  # the dev models' architecture, loaded by from_pretrained
    "policy_server.app",
    "policy_server.settings",
    "judge_server.app",
    "judge_server.settings",
    "trainer.train",
    "trainer.settings",
    "trainer.lease_client",
)
# Variables that may differ from the fork server's: read by the services' settings when they start (never at
# import), and pytest's per-test bookkeeping (PYTEST_CURRENT_TEST changes with every test).
_SAFE_PREFIXES = ("HINDSIGHT_", "PYTEST_")
# Single variables that may differ too: PYTHONPATH (the child's sys.path is rebuilt from it), and the compile cache
# torch sets in this process the first time it compiles (torch._inductor reads it when compiling, never at import;
# without this, every pytest worker that once compiled started a second fork server, about 5 CPU-seconds each).
_SAFE_NAMES = ("PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")
# OMP_NUM_THREADS is read once, when torch loads its OpenMP runtime (the fork server's import), so a child asking
# for N threads gets them the way the runtime would have set them: torch.set_num_threads(N) before it runs (the
# intra-op pool, OpenMP's and MKL's; the fork server has run no parallel region, so there is no pool to inherit).
# Only torch computes in the services, so the count other libraries read at load is left as the fork server's.
_THREADS = "OMP_NUM_THREADS"
_READY_TIMEOUT_S = 300.0  # its imports: about 5 s quiet, far longer on a loaded 2-core box


# ------------------------------------------------------------------------------------------ the fork server
@dataclass
class _Request:
    cmd: list[str]
    log_path: str
    env: dict[str, str]
    cwd: str


def _serve(proto_in: int, proto_out: int) -> _Request | None:
    """The fork server's loop: one JSON request per line on ``proto_in``, answered ``{"pid": N}`` on
    ``proto_out``; ``{"exit": N, "code": C}`` when child N ends (C as ``Popen.returncode``). Returns the request
    in a forked child (which then becomes it); returns None in the server when its client is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written on each SIGCHLD
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    sel = selectors.DefaultSelector()
    sel.register(proto_in, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    out = os.fdopen(proto_out, "w", buffering=1)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _report_exits(out)
                continue
            chunk = os.read(proto_in, 65536)
            if not chunk:
                return None  # the client closed its end: it is gone, and so (parent-death signal) are the children
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = _Request(**json.loads(line))
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    out.close()  # its buffer is empty (line-buffered): this only closes proto_out
                    for fd in (wake_r, wake_w, proto_in):
                        os.close(fd)
                    return req
                out.write(json.dumps({"pid": pid}) + "\n")
        _report_exits(out)  # a SIGCHLD that arrived while a request was served


def _report_exits(out: TextIO) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")  # -N: signal N


def _become(req: _Request, base_pythonpath: str | None, tie_to_server: Callable[[], None]) -> None:
    """In the forked child: turn into ``python -m MODULE ARGS`` as a fresh process would run it."""
    os.setsid()
    tie_to_server()
    fd = os.open(req.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(req.env)
    if _THREADS in req.env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(req.env[_THREADS]))
    os.chdir(req.cwd)
    # sys.path as `python -m` computes it: the working directory, then PYTHONPATH, then the interpreter's own.
    old = [os.path.abspath(p) for p in (base_pythonpath or "").split(os.pathsep) if p]
    new = [os.path.abspath(p) for p in req.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [req.cwd, *new, *[p for p in sys.path[1:] if os.path.abspath(p) not in old]]
    module = req.cmd[2]
    sys.argv = [module, *req.cmd[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    """Entry point of the fork server process (``python -m tests.testkit.forkserver``)."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # a stray print must not corrupt the protocol
    tie_to_server = _procs.die_with_parent_hook()  # made before any fork: in the child it takes no lock
    base_pythonpath = os.environ.get("PYTHONPATH")
    try:
        for name in _IMPORTED_BY_STARTUP:
            __import__(name)
    except Exception as exc:  # any import failure: the client starts everything the normal way
        os.write(proto_out, (json.dumps({"failed": repr(exc)}) + "\n").encode())
        return
    os.write(proto_out, (json.dumps({"ready": os.getpid()}) + "\n").encode())
    req = _serve(proto_in, proto_out)
    if req is not None:
        _become(req, base_pythonpath, tie_to_server)


# ------------------------------------------------------------------------------------------ the client side
@dataclass
class ForkedProcess:
    """A child of the fork server, with ``subprocess.Popen``'s process interface (``engine.procs.ProcessHandle``)."""

    args: list[str]
    pid: int
    _server: _Client = field(repr=False)

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never signal a PID the fork server has already reaped
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """This process's connection to its fork server."""

    def __init__(self, log_path: Path) -> None:
        self.env = _procs.child_env()
        repo = Path(__file__).resolve().parents[2]
        with open(log_path, "ab") as log:
            self.proc = _procs.popen_tied(
                [sys.executable, "-m", "tests.testkit.forkserver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                cwd=repo,
                start_new_session=True,
            )
        self._replies: queue.Queue[dict] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._children: set[int] = set()
        self._gone = False
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        first = self._replies.get(timeout=_READY_TIMEOUT_S)
        if "ready" not in first:
            raise RuntimeError(f"fork server unavailable: {first}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "exit" in msg:
                with self._cond:
                    self._exits[msg["exit"]] = msg["code"]
                    self._cond.notify_all()
            else:
                self._replies.put(msg)
        with self._cond:  # the fork server is gone: its children were SIGKILLed with it
            self._gone = True
            for pid in self._children - self._exits.keys():
                self._exits[pid] = -signal.SIGKILL
            self._cond.notify_all()
        self._replies.put({"failed": "fork server exited"})

    def fork(self, cmd: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        req = {"cmd": cmd, "log_path": str(log_path), "env": env, "cwd": os.getcwd()}
        with self._send_lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._replies.get(timeout=60)
        if "pid" not in reply:
            raise RuntimeError(f"fork server failed: {reply}")
        with self._cond:
            self._children.add(reply["pid"])
        return ForkedProcess(args=cmd, pid=reply["pid"], _server=self)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    @property
    def gone(self) -> bool:
        return self._gone

    def accepts(self, cmd: list[str], env: dict[str, str]) -> bool:
        return not self._gone and qualifies(cmd, env, self.env)


def qualifies(cmd: list[str], env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether ``cmd`` with ``env`` may be forked from a fork server started with ``server_env``."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" or cmd[2] not in PRELOADED:
        return False
    return _env_compatible(env, server_env)


def _env_compatible(env: dict[str, str], server_env: dict[str, str]) -> bool:
    differing = {k for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k)}
    return all(
        k.startswith(_SAFE_PREFIXES)
        or k in _SAFE_NAMES
        or (k == _THREADS and env.get(k, "").isdigit() and env[k] != "0")
        for k in differing
    )


_lock = threading.Lock()
_clients: list[_Client] = []  # every fork server this process started; the last one takes new requests
_unavailable = False


def _get_client(log_dir: Path) -> _Client | None:
    """The fork server for new requests. A library may set a variable in this process's environment after the
    fork server started, one its imports may read; a fresh process started now would inherit it, so a fork server
    started with the current environment takes over. Earlier ones run on until this process ends: their children
    are tied to them."""
    global _unavailable
    with _lock:
        current = _clients[-1] if _clients else None
        fresh_env = _procs.child_env()
        if not _unavailable and (current is None or current.gone or not _env_compatible(fresh_env, current.env)):
            if current is not None and (trace := os.environ.get("HINDSIGHT_TEST_FORK_SERVER_TRACE")):
                changed = sorted(
                    k for k in fresh_env.keys() | current.env.keys() if fresh_env.get(k) != current.env.get(k)
                )
                with open(trace, "a") as f:
                    f.write(f"{os.getpid()} new fork server: {'gone' if current.gone else ' '.join(changed)}\n")
            try:
                _clients.append(_Client(log_dir / "fork-server.log"))
            except Exception:  # no fork server: every command is started the normal way
                _unavailable = True
        return _clients[-1] if _clients and not _unavailable else None


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("HINDSIGHT_TEST_FORK_SERVER", "1") != "0"


def launch(cmd: list[str], *, log_path: Path, env: dict[str, str]) -> _procs.ProcessHandle:
    """An ``engine.procs.Launcher``: fork ``cmd`` from the fork server when it qualifies (module docstring), else
    start it with ``popen_launch``; either way tied to this process."""
    if enabled() and len(cmd) >= 3 and cmd[2] in PRELOADED:
        client = _get_client(log_path.parent)
        forked = client is not None and client.accepts(cmd, env)
        _trace(cmd, env, client, forked)
        if forked:
            assert client is not None
            return client.fork(cmd, log_path, env)
    return _procs.popen_launch(cmd, log_path=log_path, env=env, die_with_parent=True)


def _trace(cmd: list[str], env: dict[str, str], client: _Client | None, forked: bool) -> None:
    """With ``HINDSIGHT_TEST_FORK_SERVER_TRACE=FILE``: one line per service start, forked or fresh and why."""
    trace = os.environ.get("HINDSIGHT_TEST_FORK_SERVER_TRACE")
    if not trace:
        return
    base = client.env if client is not None else {}
    differing = sorted(k for k in env.keys() | base.keys() if env.get(k) != base.get(k))
    why = "no fork server" if client is None else " ".join(differing)
    with open(trace, "a") as f:
        f.write(f"{os.getpid()} {cmd[2]} {'forked' if forked else 'fresh'} {why}\n")


if __name__ == "__main__":
    main()
