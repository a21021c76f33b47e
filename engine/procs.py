"""Start and stop local engine processes (dev engine, sglang-router) for tests, benches and the dev stack.

Every process is started in a process group of its own and stopped through that group only (SIGTERM, then
SIGKILL after a grace period), so helpers it forks go with it; nothing is ever killed by name. Servers bind
127.0.0.1 on a free ephemeral port. ``die_with_parent=True`` (what the test kit passes) also has the kernel
SIGKILL the child when this process dies, so a killed test run leaves no server behind; the dev stack leaves
it off, as its servers outlive the command that starts them.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Protocol

import httpx


def free_port() -> int:
    """A loopback port that is free right now, picked at random OUTSIDE the kernel's ephemeral range.

    The server binds it later, in another process. A port from the ephemeral range (what ``bind(0)`` gives) can
    be handed out again in between, to another ``bind(0)`` or as the local end of any outgoing connection, and
    the server then fails with "address already in use" while something else answers on its port; a random
    pick outside that range can only meet another such pick."""
    low, high = _ephemeral_range()
    spans = [(lo, hi) for lo, hi in ((10000, low - 1), (high + 1, 65535)) if hi >= lo]
    sizes = [hi - lo + 1 for lo, hi in spans]
    for _ in range(200 if spans else 0):
        lo, hi = _rng.choices(spans, weights=sizes)[0]
        port = _rng.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room outside the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_rng = random.SystemRandom()  # not the `random` module's state: forked processes would share its sequence


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


class ProcessHandle(Protocol):
    """What is used of a started process: ``subprocess.Popen``'s names and meanings (``returncode`` is None while
    it runs, ``-N`` once signal N ended it; ``wait`` raises ``subprocess.TimeoutExpired``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts ``cmd`` as the leader of a new session (process group) with stdout and stderr appended to
    ``log_path`` and exactly ``env`` as its environment; returns at once."""

    def __call__(self, cmd: list[str], *, log_path: Path, env: dict[str, str]) -> ProcessHandle: ...


def wait_http(url: str, *, deadline_s: float = 60.0, ok_status: int = 200, proc: ProcessHandle | None = None) -> None:
    """Poll ``url`` until it answers ``ok_status``; fail fast if ``proc`` exits first."""
    end = time.monotonic() + deadline_s
    last = "no answer"
    # One client for the whole wait: each new httpx client builds an SSL context (about 20 ms of CPU), which at
    # ten polls a second would cost a fifth of a core for as long as the server takes to start.
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before {url} was ready")
            try:
                resp = client.get(url)
                if resp.status_code == ok_status:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready within {deadline_s:.0f}s ({last})")


@dataclass
class ManagedProcess:
    """A child process we started, with its URL and log file."""

    name: str
    proc: ProcessHandle
    url: str
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        # The child leads its own process group (start_new_session): the group is exactly what we started.
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._signal_group(signal.SIGKILL)  # a helper the leader forked and left behind

    def kill(self) -> None:
        """SIGKILL, as in a crash."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=5)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent_hook() -> Callable[[], None]:
    """A preexec_fn that has the kernel SIGKILL the child when the thread that forked it dies.

    libc is loaded here, before the fork: the hook itself only calls prctl and getppid (no locks taken in
    the child). A parent that died between fork and prctl is caught by the parent-pid check."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent_pid = os.getpid()

    def hook() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os._exit(1)

    return hook


@cache
def _forker() -> ThreadPoolExecutor:
    """The one thread that forks processes started with ``die_with_parent`` (it ends with the process)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="procs-forker")


def popen_tied(cmd: list[str], **popen_kwargs: object) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` whose child the kernel SIGKILLs when this process dies (on
    Linux; elsewhere a plain Popen)."""
    popen = partial(subprocess.Popen, cmd, **popen_kwargs)
    if sys.platform != "linux":
        return popen()
    # The kernel signals the child when the forking THREAD ends, so the fork happens on one thread that lives
    # as long as this process. preexec_fn is unsafe with threads only when it takes locks; the hook takes none.
    return _forker().submit(popen, preexec_fn=die_with_parent_hook()).result()


def popen_launch(
    cmd: list[str], *, log_path: Path, env: dict[str, str], die_with_parent: bool = False
) -> subprocess.Popen:
    """The default :class:`Launcher`: ``subprocess.Popen`` in a new session; ``die_with_parent`` also has the
    kernel SIGKILL it when this process dies (:func:`popen_tied`)."""
    with open(log_path, "ab") as log:
        opener = popen_tied if die_with_parent else subprocess.Popen
        return opener(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def spawn(
    name: str,
    cmd: list[str],
    *,
    url: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
    launch: Launcher | None = None,
) -> ManagedProcess:
    """Start ``cmd`` in a new process group with its output in ``log_dir/name.log``; no readiness wait.
    ``launch`` starts it (default :func:`popen_launch` with ``die_with_parent``; a given launcher decides that
    itself)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = child_env(env)
    # Logs can hold prompts and error details: readable by the owner only (0600), whatever the umask.
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)
    launch = launch or partial(popen_launch, die_with_parent=die_with_parent)
    return ManagedProcess(name=name, proc=launch(cmd, log_path=log_path, env=full_env), url=url, log_path=log_path)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a started process gets: this one's, unbuffered and offline, ``env`` on top, and no
    HTTP proxy (loopback servers must never be reached through one)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", **(env or {})}
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        full_env.pop(var, None)
    return full_env


def start_process(
    name: str,
    cmd: list[str],
    *,
    url: str,
    log_dir: Path,
    ready_path: str = "/health",
    env: dict[str, str] | None = None,
    deadline_s: float = 90.0,
    die_with_parent: bool = False,
    launch: Launcher | None = None,
) -> ManagedProcess:
    """Spawn ``cmd`` and wait until ``url + ready_path`` answers 200; on failure stop it and raise with its log tail."""
    mp = spawn(name, cmd, url=url, log_dir=log_dir, env=env, die_with_parent=die_with_parent, launch=launch)
    try:
        wait_http(mp.url + ready_path, deadline_s=deadline_s, proc=mp.proc)
    except Exception:  # noqa: BLE001 (whatever stopped the wait, the child is stopped and the error re-raised)
        tail = mp.log_tail()
        mp.stop()
        raise RuntimeError(f"{name} failed to become ready on {ready_path}:\n{tail}") from None
    return mp


def start_dev_engine(
    model_path: str | Path,
    *,
    log_dir: Path,
    name: str = "dev-engine",
    port: int | None = None,
    api_key: str | None = None,
    extra_args: list[str] | None = None,
    deadline_s: float = 90.0,
    die_with_parent: bool = False,
    launch: Launcher | None = None,
    host: str = "127.0.0.1",
) -> ManagedProcess:
    """Start ``hindsight-dev-engine`` on ``host`` (a loopback address, 127.0.0.1 by default) and wait for /health."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.dev_server.cli",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += extra_args or []
    return start_process(
        name,
        cmd,
        url=f"http://{host}:{port}",
        log_dir=log_dir,
        deadline_s=deadline_s,
        die_with_parent=die_with_parent,
        launch=launch,
    )


def start_router(
    worker_urls: list[str],
    *,
    log_dir: Path,
    name: str = "router",
    port: int | None = None,
    api_key: str | None = None,
    policy: str = "round_robin",
    health_check_interval_s: int = 1,
    deadline_s: float = 60.0,
    extra_args: list[str] | None = None,
    die_with_parent: bool = False,
    launch: Launcher | None = None,
    host: str = "127.0.0.1",
) -> ManagedProcess:
    """Start the real ``sglang-router`` (0.3.2) on ``host`` (a loopback address, 127.0.0.1 by default) and wait on
    /readiness (not /health)."""
    port = port or free_port()
    prom_port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prom_port),
        "--shutdown-grace-period-secs",
        "1",
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        str(health_check_interval_s),
        "--health-failure-threshold",
        "1",
        "--log-level",
        "warn",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += extra_args or []
    # /readiness, not /health: the router answers /health with 200 even with no healthy worker.
    mp = start_process(
        name,
        cmd,
        url=f"http://{host}:{port}",
        log_dir=log_dir,
        ready_path="/readiness",
        deadline_s=deadline_s,
        die_with_parent=die_with_parent,
        launch=launch,
    )
    mp.extra["prometheus_port"] = prom_port
    return mp
