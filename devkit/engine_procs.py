"""Start the local engines of the dev stack, tests and benches: the CPU dev engine and the real sglang-router.

Both go through :func:`engine.procs.start_process` (a process group of their own, on a loopback address and a free port,
stopped through that group only) and are ready when their health route answers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engine.procs import Launcher, ManagedProcess, free_port, start_process


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
        "devkit.dev_server.cli",
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
