"""The CPU dev stack: the whole Hindsight serving loop on 127.0.0.1, started and stopped by PID.

    python launch/devstack.py start|stop|status     (normally through launch/dev.sh)

Contract (docs/LAUNCH.md "CPU dev stack"):
- ``start`` builds the tiny policy model and its teacher under ``$HINDSIGHT_RUN_DIR/models`` when
  missing (``hindsight-tiny-model``; the teacher via ``--teacher-of --prefer-text``), then starts on free
  loopback ports, each waited on with a deadline: the policy dev engine behind a real sglang-router, the
  judge/teacher dev engine behind a second router, ``hindsight-judge`` (backend ``$JUDGE_BACKEND``,
  llm by default; openai talks to that router's ``/v1/chat/completions``) and ``hindsight-policy`` (``$MODE``: rl|opd|combine). It returns once everything is
  ready, after writing ``$HINDSIGHT_RUN_DIR/endpoints.json`` (policy_url, judge_url, policy_engine_url,
  judge_engine_url, the routers' URLs and Prometheus metrics URLs, api_key, admin_api_key, mode,
  judge_backend, model paths, data/checkpoint dirs).
- Every process runs in its own session; ``pids.json`` records name, PID and kernel start time after
  each start. ``stop`` signals only those process groups, and only when the PID still belongs to the
  process we started (start time matches), SIGTERM then SIGKILL after a grace period; it never looks
  processes up by name. A failed ``start`` stops what it had started and says which part failed,
  with the tail of its log.
- ``start`` on a running stack prints the endpoints and changes nothing; leftovers of a half-dead stack
  are stopped first.
- ``HINDSIGHT_DEV_STOP_WITH_PID=<pid>`` at ``start`` ties the stack to that process (a test runner, an IDE):
  a watchdog, recorded in ``pids.json`` like the services, stops the stack as ``stop`` would once that
  process is gone, however it ended (the services run in sessions of their own, so no signal of its death
  reaches them otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from devkit.engine_procs import start_dev_engine, start_router
from devkit.tiny_model import CHAT_TEMPLATE_PATH
from engine.procs import ManagedProcess, free_port, spawn, wait_http

TEACHER_PREFERRED_TEXT = "Thanks, that worked."
# Context of the dev models in tokens: a real agent's prompt fits (OpenClaw's default system prompt and 12 tools
# are about 32k tokens with the tiny tokenizer) with room to grow before the agent compacts (at 3/4 of it). A
# prefill that long takes the CPU dev engine seconds (DEV_POLICY_LAYERS); its prefix cache reuses it next turn.
DEV_CONTEXT_TOKENS = 65536
# Decoder layers of the dev policy (and so of its teacher): attention over a real agent's 32k-token prompt is most of
# what the CPU stack spends (prefill, decode and the trainer's forward and backward), and it scales with the layers:
# one layer serves OpenClaw's prompt in about 4.5 CPU-seconds where two take 8.7. What the stack shows (token-exact
# turns, judging, training, weight updates) does not depend on depth.
DEV_POLICY_LAYERS = 1
# The dev engines' prefix cache (tokens of KV, about 1 KB each for the tiny model) holds a few such prompts.
DEV_PREFIX_CACHE_TOKENS = 262144
READY_DEADLINE_S = float(os.environ.get("HINDSIGHT_DEV_READY_TIMEOUT_S", "120"))
STOP_GRACE_S = float(os.environ.get("HINDSIGHT_DEV_STOP_GRACE_S", "15"))
# The tiny judge writes random text: keep its free-form parts short so a vote costs well under a second,
# and constrain its output with the templates' regexes so every vote parses (random but well-formed).
DEV_JUDGE_ENV = {
    "HINDSIGHT_JUDGE_CONSTRAIN_OUTPUT": "true",
    "HINDSIGHT_JUDGE_REASONING_MAX_CHARS": "40",
    "HINDSIGHT_JUDGE_HINT_MAX_CHARS": "60",
    "HINDSIGHT_JUDGE_MAX_NEW_TOKENS": "96",
    # Judging an agent's turn prefills its whole context (32k tokens for OpenClaw): minutes on a loaded CPU.
    "HINDSIGHT_JUDGE_REQUEST_DEADLINE_S": "900",
}


def say(msg: str) -> None:
    print(msg, flush=True)


def run_dir_from_env() -> Path:
    return Path(os.environ.get("HINDSIGHT_RUN_DIR", ".hindsight/dev")).resolve()


def console_script(name: str) -> str:
    """The entry point installed next to this interpreter (same venv), else the one on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


# --- PID bookkeeping -------------------------------------------------------------------------------


def proc_start_ticks(pid: int) -> int | None:
    """Kernel start time of ``pid`` (field 22 of /proc/PID/stat), or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are space separated.
    return int(stat.rsplit(")", 1)[1].split()[19])


def read_pids(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except FileNotFoundError:
        return []


def write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def is_ours(entry: dict) -> bool:
    """The recorded process still runs: same PID and start time, and not a zombie (exited, not yet reaped by
    its parent, e.g. a container's PID 1 that reaps nothing; it holds no port and takes no signal)."""
    return proc_start_ticks(entry["pid"]) == entry["start_ticks"] and not _is_zombie(entry["pid"])


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def stop_entries(entries: list[dict]) -> list[str]:
    """SIGTERM each recorded process group that is still ours, wait, SIGKILL the stubborn; newest first."""
    live = [e for e in reversed(entries) if is_ours(e)]
    for e in live:
        try:
            os.killpg(e["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < end and any(is_ours(e) for e in live):
        _reap(live)
        time.sleep(0.1)
    for e in live:
        if is_ours(e):
            say(f"  {e['name']} (pid {e['pid']}) ignored SIGTERM for {STOP_GRACE_S:.0f}s: SIGKILL")
            try:
                os.killpg(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    _reap(live)
    return [e["name"] for e in live]


def _reap(entries: list[dict]) -> None:
    # Children of this very process (a failed start) must be waited for, or they linger as zombies.
    for e in entries:
        try:
            os.waitpid(e["pid"], os.WNOHANG)
        except ChildProcessError:
            pass


# --- start -----------------------------------------------------------------------------------------


class Stack:
    """Starts the parts in order, recording each PID before waiting on the next."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.entries: list[dict] = []

    def record(self, mp: ManagedProcess) -> ManagedProcess:
        ticks = proc_start_ticks(mp.pid)
        self.entries.append(
            {"name": mp.name, "pid": mp.pid, "start_ticks": ticks, "url": mp.url, "log": str(mp.log_path)}
        )
        write_json(self.run_dir / "pids.json", self.entries)
        return mp

    def service(
        self, name: str, cmd: list[str], env: dict[str, str], ready_path: str, port: int, host: str = "127.0.0.1"
    ) -> ManagedProcess:
        mp = self.record(spawn(name, cmd, url=f"http://{host}:{port}", log_dir=self.log_dir, env=env))
        try:
            wait_http(mp.url + ready_path, deadline_s=READY_DEADLINE_S, proc=mp.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(
                f"{name} failed to become ready: {exc}\n--- {mp.log_path} (tail)\n{mp.log_tail()}"
            ) from None
        return mp


def flag_if_set(flag: str, value: str | None) -> list[str]:
    """``[flag, value]`` when the user set the knob, else nothing (the program's default applies)."""
    return [flag, value] if value else []


def _stale_model(out: Path) -> str | None:
    """Why the model an earlier dev stack left in ``out`` is not today's (its context, its chat template), or None."""
    if json.loads((out / "config.json").read_text()).get("max_position_embeddings") != DEV_CONTEXT_TOKENS:
        return f"holds fewer than {DEV_CONTEXT_TOKENS} tokens"
    template = out / "chat_template.jinja"
    if not template.is_file() or template.read_bytes() != CHAT_TEMPLATE_PATH.read_bytes():
        return "has another chat template than the tiny models' (Qwen3's)"
    return None


def build_models(run_dir: Path) -> tuple[Path, Path]:
    models = run_dir / "models"
    policy, teacher = models / "policy", models / "teacher"
    tool = [sys.executable, "-m", "devkit.tiny_model_cli"]  # hindsight-tiny-model, from this checkout
    log = run_dir / "logs" / "models.log"
    for out, extra, what in (
        (
            policy,
            ["--max-position-embeddings", str(DEV_CONTEXT_TOKENS), "--layers", str(DEV_POLICY_LAYERS)],
            "tiny policy model",
        ),
        (
            teacher,
            ["--teacher-of", str(policy), "--prefer-text", TEACHER_PREFERRED_TEXT],
            f"teacher (fine-tuned to prefer {TEACHER_PREFERRED_TEXT!r})",
        ),
    ):
        if (out / "config.json").exists() and any(out.glob("*.safetensors")):
            stale = _stale_model(out)
            if stale is None:
                continue
            say(f"{out} {stale} (an older dev stack's): rebuilding it")
        say(f"building the {what} in {out} ...")
        t0 = time.monotonic()
        with open(log, "ab") as fh:
            res = subprocess.run([*tool, str(out), "--seed", "0", *extra], stdout=fh, stderr=subprocess.STDOUT)
        if res.returncode != 0:
            raise RuntimeError(f"hindsight-tiny-model failed for {out} (see {log})")
        say(f"  done in {time.monotonic() - t0:.1f}s")
    return policy, teacher


def start(run_dir: Path, mode: str | None, judge_backend: str | None) -> dict:
    entries = read_pids(run_dir)
    running = running_endpoints(run_dir, entries)
    if running is not None:
        say(f"dev stack already running (mode {running['mode']}); `launch/dev.sh stop` first to restart it")
        return running
    endpoints_path = run_dir / "endpoints.json"
    if entries:
        stopped = stop_entries(entries)
        say(f"stopped leftovers of an earlier dev stack: {', '.join(stopped) or 'none alive'}")
        (run_dir / "pids.json").unlink(missing_ok=True)
    endpoints_path.unlink(missing_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").chmod(0o700)  # logs can hold prompts: the owner's only, like the data dir
    policy_model, teacher_model = build_models(run_dir)

    stack = Stack(run_dir)
    owner = os.environ.get(OWNER_ENV)
    if owner:
        start_watchdog(stack, int(owner))
    api_key, admin_api_key = "sk-dev-" + secrets.token_hex(8), "sk-admin-" + secrets.token_hex(8)
    t0 = time.monotonic()
    try:
        say("starting the policy dev engine and its router ...")
        p_engine = stack.record(
            start_dev_engine(
                policy_model,
                log_dir=stack.log_dir,
                name="policy-engine",
                deadline_s=READY_DEADLINE_S,
                extra_args=[
                    "--served-model-name",
                    "hindsight-policy",
                    "--prefix-cache-max-tokens",
                    str(DEV_PREFIX_CACHE_TOKENS),
                ],
            )
        )
        p_router = stack.record(start_router([p_engine.url], log_dir=stack.log_dir, name="policy-router"))
        # The policy engine's start above on purpose: two engines, each with its own model, name and router.
        say("starting the judge/teacher dev engine and its router ...")
        j_engine = stack.record(
            start_dev_engine(
                teacher_model,
                log_dir=stack.log_dir,
                name="judge-engine",
                deadline_s=READY_DEADLINE_S,
                extra_args=[
                    "--served-model-name",
                    "judge",
                    "--seed",
                    "1",
                    "--prefix-cache-max-tokens",
                    str(DEV_PREFIX_CACHE_TOKENS),
                ],
            )
        )
        j_router = stack.record(start_router([j_engine.url], log_dir=stack.log_dir, name="judge-router"))

        say(f"starting hindsight-judge (backend {judge_backend or 'default'}) ...")
        judge_port = free_port()
        judge = stack.service(
            "judge",
            [
                console_script("hindsight-judge"),
                # backend openai: the same router's OpenAI-compatible chat route instead of /generate
                *(
                    ["--base-url", j_router.url + "/v1", "--model", "judge"]
                    if judge_backend == "openai"
                    else ["--engine-url", j_router.url]
                ),
                "--host",  # loopback whatever HINDSIGHT_*_HOST says: the dev stack is never exposed
                "127.0.0.1",
                "--port",
                str(judge_port),
                *flag_if_set("--backend", judge_backend),
            ],
            {"HINDSIGHT_JUDGE_API_KEY": api_key, **DEV_JUDGE_ENV},
            "/ready",
            judge_port,
        )

        say(f"starting hindsight-policy (mode {mode or 'default'}) ...")
        policy_port = free_port()
        data_dir = run_dir / "data"
        policy = stack.service(
            "policy",
            [
                console_script("hindsight-policy"),
                "--model-path",
                str(policy_model),
                "--engine-url",
                p_router.url,
                "--engine-worker-urls",
                p_engine.url,
                "--judge-url",
                judge.url,
                "--teacher-url",
                j_router.url,
                "--data-dir",
                str(data_dir),
                "--host",  # loopback whatever HINDSIGHT_*_HOST says: the dev stack is never exposed
                "127.0.0.1",
                "--port",
                str(policy_port),
                *flag_if_set("--mode", mode),
            ],
            {
                "HINDSIGHT_POLICY_API_KEY": api_key,
                "HINDSIGHT_POLICY_ADMIN_API_KEY": admin_api_key,
                "HINDSIGHT_POLICY_JUDGE_API_KEY": api_key,
                # Agents' turns are minutes apart (an OpenClaw turn on this CPU stack takes one to two): a
                # session stays open this long without a request (HINDSIGHT_DEV_SESSION_IDLE_TIMEOUT_S).
                "HINDSIGHT_POLICY_SESSION_IDLE_TIMEOUT_S": os.environ.get(
                    "HINDSIGHT_DEV_SESSION_IDLE_TIMEOUT_S", "600"
                ),
                # A CPU prefill of an agent's 32k-token prompt can take minutes on a loaded machine.
                "HINDSIGHT_POLICY_ENGINE_DEADLINE_S": "600",
            },
            "/ready",
            policy_port,
        )
    except BaseException as exc:
        say(f"dev stack failed to start; stopping what was started ({', '.join(e['name'] for e in stack.entries)})")
        stop_entries(stack.entries)
        (run_dir / "pids.json").unlink(missing_ok=True)
        if isinstance(exc, RuntimeError):
            raise SystemExit(f"error: {exc}") from None
        raise

    # What the services run with, unset knobs included (their own defaults), read back from them.
    mode = httpx.get(
        policy.url + "/admin/mode", headers={"Authorization": f"Bearer {admin_api_key}"}, timeout=10, trust_env=False
    ).json()["mode"]
    judge_backend = httpx.get(
        judge.url + "/ready", headers={"Authorization": f"Bearer {api_key}"}, timeout=10, trust_env=False
    ).json()["backend"]
    endpoints = {
        "mode": mode,
        "judge_backend": judge_backend,
        "policy_url": policy.url,
        "judge_url": judge.url,
        "policy_engine_url": p_engine.url,
        "policy_router_url": p_router.url,
        "judge_engine_url": j_engine.url,
        "judge_router_url": j_router.url,
        "teacher_url": j_router.url,
        # sglang-router serves its Prometheus metrics on a port of its own (the deploy/ scrape config's targets)
        "policy_router_metrics_url": f"http://127.0.0.1:{p_router.extra['prometheus_port']}",
        "judge_router_metrics_url": f"http://127.0.0.1:{j_router.extra['prometheus_port']}",
        "api_key": api_key,
        "admin_api_key": admin_api_key,
        "policy_model_path": str(policy_model),
        "teacher_model_path": str(teacher_model),
        "data_dir": str(data_dir),
        "checkpoint_dir": str(run_dir / "checkpoints"),
        "log_dir": str(stack.log_dir),
    }
    ready = f"dev stack ready in {time.monotonic() - t0:.1f}s (mode {mode}, judge backend {judge_backend})"
    publish_endpoints(run_dir, endpoints, ready, ("policy_url", "judge_url", "policy_engine_url", "judge_router_url"))
    return endpoints


def running_endpoints(run_dir: Path, entries: list[dict]) -> dict | None:
    """The recorded endpoints when every recorded process still runs (a start has nothing to do), else None."""
    endpoints_path = run_dir / "endpoints.json"
    if entries and all(is_ours(e) for e in entries) and endpoints_path.exists():
        endpoints: dict = json.loads(endpoints_path.read_text())
        return endpoints
    return None


def publish_endpoints(run_dir: Path, endpoints: dict, ready_line: str, shown: tuple[str, ...]) -> None:
    """Write endpoints.json (owner-only: it holds the keys) and say the ready line with the ``shown`` URLs."""
    endpoints_path = run_dir / "endpoints.json"
    write_json(endpoints_path, endpoints)
    os.chmod(endpoints_path, 0o600)
    say(ready_line)
    for name in shown:
        say(f"  {name:18s} {endpoints[name]}")
    say(f"  endpoints + keys   {endpoints_path}")


# --- owner watchdog ---------------------------------------------------------------------------------
OWNER_ENV = "HINDSIGHT_DEV_STOP_WITH_PID"
WATCH_INTERVAL_S = 1.0


def start_watchdog(stack: Stack, owner_pid: int) -> ManagedProcess:
    """Record a watchdog that stops the stack when ``owner_pid`` (as it is now) is gone."""
    ticks = proc_start_ticks(owner_pid)
    if ticks is None:
        raise SystemExit(f"error: {OWNER_ENV}={owner_pid}: no such process")
    cmd = [sys.executable, __file__, "watch", str(owner_pid), str(ticks)]
    env = {"HINDSIGHT_RUN_DIR": str(stack.run_dir)}
    return stack.record(spawn("watchdog", cmd, url="", log_dir=stack.log_dir, env=env))


def watch(run_dir: Path, owner_pid: int, owner_ticks: int) -> None:
    """Wait for the owner to end (its PID gone or reused), then stop everything else ``pids.json`` records."""
    while proc_start_ticks(owner_pid) == owner_ticks:
        time.sleep(WATCH_INTERVAL_S)
    entries = [e for e in read_pids(run_dir) if e["pid"] != os.getpid()]
    stopped = stop_entries(entries)
    (run_dir / "pids.json").unlink(missing_ok=True)
    (run_dir / "endpoints.json").unlink(missing_ok=True)
    say(f"owner {owner_pid} is gone: stopped {', '.join(stopped) or 'nothing'}")


def stop(run_dir: Path) -> None:
    entries = read_pids(run_dir)
    if not entries:
        say(f"no dev stack recorded in {run_dir}")
        return
    forget_stopped(run_dir, entries, stop_entries(entries))


def forget_stopped(run_dir: Path, entries: list[dict], stopped: list[str]) -> None:
    """After a stop: fail naming whatever of ``entries`` still runs, else drop the run files and say what stopped."""
    left = [e for e in entries if is_ours(e)]
    if left:
        raise SystemExit(f"error: still running: {', '.join(e['name'] + ' ' + str(e['pid']) for e in left)}")
    (run_dir / "pids.json").unlink(missing_ok=True)
    (run_dir / "endpoints.json").unlink(missing_ok=True)
    say(f"stopped {', '.join(stopped) if stopped else 'nothing (all had already exited)'}")


def status(run_dir: Path, what: str = "dev stack") -> int:
    """One line per recorded process (running or not); 0 when all run, 1 otherwise or when none is recorded."""
    entries = read_pids(run_dir)
    if not entries:
        say(f"no {what} recorded in {run_dir}")
        return 1
    for e in entries:
        say(f"  {e['name']:16s} pid {e['pid']:<8d} {'running' if is_ours(e) else 'NOT running':12s} {e['url']}")
    return 0 if all(is_ours(e) for e in entries) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/dev.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "status", "watch"])
    parser.add_argument("owner", nargs="*", type=int, help=argparse.SUPPRESS)  # watch: PID and start ticks
    args = parser.parse_args(argv)
    run_dir = run_dir_from_env()
    if args.command == "watch":
        watch(run_dir, *args.owner)
        return 0
    # Unset or empty: no flag, the service's own default applies.
    mode = os.environ.get("MODE") or None
    backend = os.environ.get("JUDGE_BACKEND") or None
    if mode not in (None, "rl", "opd", "combine"):
        parser.error(f"MODE={mode!r}: use rl, opd or combine")
    if backend not in (None, "llm", "openai", "rules"):
        parser.error(f"JUDGE_BACKEND={backend!r}: use llm, openai or rules")
    if args.command == "start":
        run_dir.mkdir(parents=True, exist_ok=True)
        start(run_dir, mode, backend)
        return 0
    if args.command == "stop":
        stop(run_dir)
        return 0
    return status(run_dir)


if __name__ == "__main__":
    sys.exit(main())
