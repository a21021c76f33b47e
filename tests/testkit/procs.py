"""Server processes for tests and benches: engine.procs' and devkit.engine_procs' helpers, with every process tied to this one.

Each process is started in a process group of its own with a parent-death signal (``die_with_parent``), so
whatever this Python process is (pytest, a bench) and however it ends (an exception, Ctrl-C, ``kill -9``),
the kernel kills what it started; ``ManagedProcess.stop`` stops the whole group. The dev engine, policy, judge
and trainer CLIs are forked from a fork server that has imported them (``tests.testkit.forkserver``). The names mirror
those modules', so a test imports them from here and nothing else changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from devkit import engine_procs
from engine import procs as _procs
from engine.procs import ManagedProcess, free_port, wait_http
from tests.testkit import forkserver

# The services' own CLIs are forked from a process that has already imported them (tests.testkit.forkserver:
# about 0.2 s to serving instead of 4-6 CPU-seconds of imports each); everything else is a fresh process. Either
# way forkserver.launch ties it to this process (the parent-death signal).
spawn = partial(_procs.spawn, launch=forkserver.launch)
start_process = partial(_procs.start_process, launch=forkserver.launch)
start_dev_engine = partial(engine_procs.start_dev_engine, launch=forkserver.launch)
start_router = partial(engine_procs.start_router, launch=forkserver.launch)


REPO = Path(__file__).resolve().parents[2]

# One TLS context for every client the tests build. They talk plain HTTP to 127.0.0.1, yet each new httpx client
# loads the CA bundle into a context of its own (about 20 ms of CPU): a helper polled every 50 ms would spend 40 %
# of a core on that alone. With this context a client costs under a millisecond.
TLS = httpx.create_ssl_context()


def http_client(**kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` for a test server: no proxy from the environment, the shared TLS context."""
    return httpx.Client(trust_env=False, verify=TLS, **kwargs)


def async_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """:func:`http_client`'s asyncio twin."""
    return httpx.AsyncClient(trust_env=False, verify=TLS, **kwargs)


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs: absent, or a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def dev_sh_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """The environment for ``launch/dev.sh`` in ``run_dir``: this interpreter and checkout, and the stack tied to
    this process (``HINDSIGHT_DEV_STOP_WITH_PID``: its watchdog stops it if this process dies without ``stop``)."""
    return {
        **os.environ,
        "HINDSIGHT_RUN_DIR": str(run_dir),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "HINDSIGHT_DEV_STOP_WITH_PID": str(os.getpid()),
        **extra,
    }


def dev_sh(cmd: str, run_dir: Path, timeout_s: float, **extra: str) -> subprocess.CompletedProcess[str]:
    """``launch/dev.sh cmd`` in ``run_dir`` (see :func:`dev_sh_env`), its output captured."""
    return subprocess.run(
        ["bash", str(REPO / "launch" / "dev.sh"), cmd],
        cwd=REPO,
        env=dev_sh_env(run_dir, **extra),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples ``name`` at ``url/metrics`` whose labels include ``labels`` (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with http_client(timeout=5) as c:
        text = c.get(url + "/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


__all__ = [
    "ManagedProcess",
    "free_port",
    "http_client",
    "metric_value",
    "spawn",
    "start_dev_engine",
    "start_process",
    "start_router",
    "wait_http",
]
