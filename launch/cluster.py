"""The multi-host layout of docs/SCALING.md on one machine: every "host" on its own loopback address.

    python launch/cluster.py start|stop|status      (normally through launch/cluster.sh)

Contract (docs/LAUNCH.md "Cluster on one machine"):
- ``start`` builds the dev models like the CPU dev stack (launch/devstack.py, whose starters it reuses) and
  starts, each on the address :data:`HOSTS` gives it (127.0.0.11, .12, ...): PostgreSQL (a private cluster,
  devkit.pgcluster); 2 policy dev engines behind a real sglang-router; 2 judge engines behind their router;
  2 ``hindsight-judge`` and 3 ``hindsight-policy`` replicas (one shared ``--store-url``) behind HAProxy
  (Debian's package), which health-checks ``/ready``; a 2-rank ``torchrun`` trainer (gloo on CPU) leasing
  through the load balancer. It returns once all are ready, after writing ``$HINDSIGHT_RUN_DIR/endpoints.json``
  (URLs of every part, the keys, the database URL, model and checkpoint dirs).
- ``pids.json`` records every process started here (name, PID, kernel start time, URL, log), PostgreSQL's
  postmaster included. ``stop`` signals only those process groups whose PID still belongs to what was started
  (launch/devstack.py's ``stop_entries``), then stops PostgreSQL with ``pg_ctl stop`` on its own data dir and
  removes that dir; nothing is looked up by name. A failed ``start`` stops what it had started.
- ``HINDSIGHT_CLUSTER_SESSION_IDLE_TIMEOUT_S`` (default 600) is the policy replicas' idle timeout (the soak
  sets a short one so its sessions close); ``HINDSIGHT_CLUSTER_TRAINER=0`` leaves the trainer out; ``HINDSIGHT_CLUSTER_TRAINER_ARGS`` adds ``hindsight-train`` flags.
- HAProxy missing: ``start`` fails at once saying so (``apt-get install haproxy``), before starting anything.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

# The dev tooling this launcher uses, imported in one place (the package may move).
from devkit.engine_procs import start_dev_engine, start_router
from devkit.pgcluster import PgCluster, pg_bindir
from engine.procs import ManagedProcess, free_port, spawn, wait_http
from launch.devstack import (
    DEV_JUDGE_ENV,
    DEV_PREFIX_CACHE_TOKENS,
    READY_DEADLINE_S,
    Stack,
    build_models,
    console_script,
    forget_stopped,
    is_ours,
    proc_start_ticks,
    publish_endpoints,
    read_pids,
    running_endpoints,
    say,
    stop_entries,
    write_json,
)
from launch.devstack import status as devstack_status

# One loopback address per "host" (127.0.0.0/8 is all local on Linux).
HOSTS = {
    "postgres": "127.0.0.11",
    "lb": "127.0.0.12",
    "policy-1": "127.0.0.13",
    "policy-2": "127.0.0.14",
    "policy-3": "127.0.0.15",
    "judge-1": "127.0.0.16",
    "judge-2": "127.0.0.17",
    "policy-engine-1": "127.0.0.18",
    "policy-engine-2": "127.0.0.19",
    "policy-router": "127.0.0.20",
    "judge-engine-1": "127.0.0.21",
    "judge-engine-2": "127.0.0.22",
    "judge-router": "127.0.0.23",
    "trainer": "127.0.0.24",
}
POLICY_REPLICAS = ("policy-1", "policy-2", "policy-3")
JUDGE_SERVERS = ("judge-1", "judge-2")
TRAINER_RANKS = 2


def run_dir_from_env() -> Path:
    return Path(os.environ.get("HINDSIGHT_RUN_DIR", ".hindsight/cluster")).resolve()


def haproxy_binary() -> str:
    path = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None)
    if not path:
        raise SystemExit("error: haproxy not found: install Debian's package (apt-get install -y haproxy)")
    return path


def haproxy_config(policy: list[str], judge: list[str], policy_port: int, judge_port: int, stats_port: int) -> str:
    """Two frontends on the load balancer's address, round robin, ``/ready`` checked every second."""

    def backend(name: str, urls: list[str]) -> str:
        servers = "\n".join(
            f"    server {name}{i + 1} {u.removeprefix('http://')} check inter 1s fall 1 rise 1"
            for i, u in enumerate(urls)
        )
        return f"backend {name}\n    balance roundrobin\n    option httpchk GET /ready\n{servers}\n"

    lb = HOSTS["lb"]
    return (
        "global\n    maxconn 2000\n\n"
        "defaults\n    mode http\n    timeout connect 2s\n    timeout client 900s\n    timeout server 900s\n"
        "    option redispatch\n    retries 2\n\n"
        f"frontend policy_in\n    bind {lb}:{policy_port}\n    default_backend policy\n\n"
        f"frontend judge_in\n    bind {lb}:{judge_port}\n    default_backend judge\n\n"
        f"frontend stats\n    bind {lb}:{stats_port}\n    stats enable\n    stats uri /stats\n\n"
        + backend("policy", policy)
        + "\n"
        + backend("judge", judge)
    )


def record_postgres(stack: Stack, pg: PgCluster) -> None:
    pid = pg.postmaster_pid()
    mp = ManagedProcess("postgres", _Pid(pid), f"postgresql://{pg.host}:{pg.port}", pg.data_dir.parent / "postgres.log")
    stack.record(mp)


class _Pid:
    """A process this one did not fork (the postmaster pg_ctl started): only its PID is known."""

    def __init__(self, pid: int):
        self.pid = pid


def start_parallel(*starters):  # type: ignore[no-untyped-def]
    """Start engines side by side (each waits on its own /health); all results, or the first error."""
    with ThreadPoolExecutor(max_workers=len(starters)) as pool:
        futures = [pool.submit(s) for s in starters]
        return [f.result() for f in futures]


def start(run_dir: Path) -> dict:
    entries = read_pids(run_dir)
    running = running_endpoints(run_dir, entries)
    if running is not None:
        say("cluster already running; `launch/cluster.sh stop` first to restart it")
        return running
    if entries:
        stop(run_dir)
    haproxy = haproxy_binary()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").chmod(0o700)
    policy_model, teacher_model = build_models(run_dir)
    stack = Stack(run_dir)
    api_key, admin_api_key = "sk-dev-" + secrets.token_hex(8), "sk-admin-" + secrets.token_hex(8)
    session_idle_s = os.environ.get("HINDSIGHT_CLUSTER_SESSION_IDLE_TIMEOUT_S", "600")
    pg: PgCluster | None = None
    t0 = time.monotonic()
    try:
        say(f"starting PostgreSQL on {HOSTS['postgres']} ...")
        pg = PgCluster.start(fsync=False, host=HOSTS["postgres"])
        write_json(run_dir / "postgres.json", {"data_dir": str(pg.data_dir), "port": pg.port, "host": pg.host})
        record_postgres(stack, pg)
        store_url = pg.create_database("hindsight")

        say("starting 2 policy and 2 judge dev engines ...")

        def engine(name: str, model: Path, served: str, seed: int) -> ManagedProcess:
            args = ["--served-model-name", served, "--seed", str(seed)]
            args += ["--prefix-cache-max-tokens", str(DEV_PREFIX_CACHE_TOKENS)]
            return start_dev_engine(
                model, log_dir=stack.log_dir, name=name, deadline_s=READY_DEADLINE_S, extra_args=args, host=HOSTS[name]
            )

        engines = start_parallel(
            lambda: engine("policy-engine-1", policy_model, "hindsight-policy", 0),
            lambda: engine("policy-engine-2", policy_model, "hindsight-policy", 0),
            lambda: engine("judge-engine-1", teacher_model, "judge", 1),
            lambda: engine("judge-engine-2", teacher_model, "judge", 2),
        )
        for mp in engines:
            stack.record(mp)
        p_engines, j_engines = engines[:2], engines[2:]
        say("starting the two sglang-routers ...")
        p_router, j_router = start_parallel(
            lambda: start_router(
                [e.url for e in p_engines], log_dir=stack.log_dir, name="policy-router", host=HOSTS["policy-router"]
            ),
            lambda: start_router(
                [e.url for e in j_engines], log_dir=stack.log_dir, name="judge-router", host=HOSTS["judge-router"]
            ),
        )
        stack.record(p_router)
        stack.record(j_router)

        lb_policy_port, lb_judge_port, lb_stats_port = free_port(), free_port(), free_port()
        judge_lb_url = f"http://{HOSTS['lb']}:{lb_judge_port}"
        say("starting 2 judge servers and 3 policy replicas ...")
        judges = []
        for name in JUDGE_SERVERS:
            port = free_port()
            cmd = [console_script("hindsight-judge"), "--engine-url", j_router.url]
            cmd += ["--host", HOSTS[name], "--port", str(port)]
            env = {"HINDSIGHT_JUDGE_API_KEY": api_key, **DEV_JUDGE_ENV}
            judges.append(
                stack.record(spawn(name, cmd, url=f"http://{HOSTS[name]}:{port}", log_dir=stack.log_dir, env=env))
            )
        replicas = []
        for name in POLICY_REPLICAS:
            port = free_port()
            cmd = [
                console_script("hindsight-policy"),
                *("--model-path", str(policy_model), "--engine-url", p_router.url),
                *("--engine-worker-urls", ",".join(e.url for e in p_engines)),
                *("--judge-url", judge_lb_url, "--teacher-url", j_router.url),
                *("--store-url", store_url, "--replica-id", name, "--data-dir", str(run_dir / "data" / name)),
                *("--host", HOSTS[name], "--port", str(port)),
            ]
            env = {
                "HINDSIGHT_POLICY_API_KEY": api_key,
                "HINDSIGHT_POLICY_ADMIN_API_KEY": admin_api_key,
                "HINDSIGHT_POLICY_JUDGE_API_KEY": api_key,
                "HINDSIGHT_POLICY_SESSION_IDLE_TIMEOUT_S": session_idle_s,
                "HINDSIGHT_POLICY_ENGINE_DEADLINE_S": "600",
            }
            replicas.append(
                stack.record(spawn(name, cmd, url=f"http://{HOSTS[name]}:{port}", log_dir=stack.log_dir, env=env))
            )
        for mp in [*judges, *replicas]:
            try:
                wait_http(mp.url + "/ready", deadline_s=READY_DEADLINE_S, proc=mp.proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{mp.name} failed to become ready: {exc}\n{mp.log_tail()}") from None

        say(f"starting HAProxy on {HOSTS['lb']} ...")
        cfg = run_dir / "haproxy.cfg"
        cfg.write_text(
            haproxy_config(
                [r.url for r in replicas], [j.url for j in judges], lb_policy_port, lb_judge_port, lb_stats_port
            )
        )
        lb = stack.record(
            spawn(
                "haproxy",
                [haproxy, "-db", "-f", str(cfg)],
                url=f"http://{HOSTS['lb']}:{lb_policy_port}",
                log_dir=stack.log_dir,
            )
        )
        wait_http(lb.url + "/ready", deadline_s=READY_DEADLINE_S, proc=lb.proc)
        wait_http(judge_lb_url + "/ready", deadline_s=READY_DEADLINE_S, proc=lb.proc)

        trainer_url = ""
        if os.environ.get("HINDSIGHT_CLUSTER_TRAINER", "1") != "0":
            say(f"starting the {TRAINER_RANKS}-rank torchrun trainer ...")
            rdzv = f"{HOSTS['trainer']}:{free_port()}"
            cmd = [
                sys.executable,
                *("-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={TRAINER_RANKS}"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--local-addr", HOSTS["trainer"]),
                *("-m", "trainer.cli", "--policy-url", lb.url, "--model-path", str(policy_model)),
                *("--out-dir", str(run_dir / "checkpoints"), "--steps", "0", "--no-progress"),
                *("--batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-2"),
                *os.environ.get("HINDSIGHT_CLUSTER_TRAINER_ARGS", "").split(),
            ]
            env = {
                "HINDSIGHT_TRAIN_ADMIN_API_KEY": admin_api_key,
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                "MASTER_ADDR": HOSTS["trainer"],
            }
            stack.record(spawn("trainer", cmd, url="", log_dir=stack.log_dir, env=env))
            trainer_url = f"torchrun c10d {rdzv}"
    except BaseException as exc:
        say(f"cluster failed to start; stopping what was started ({', '.join(e['name'] for e in stack.entries)})")
        stop(run_dir)
        if isinstance(exc, RuntimeError | TimeoutError):
            raise SystemExit(f"error: {exc}") from None
        raise

    endpoints = {
        "hosts": HOSTS,
        "policy_url": lb.url,
        "judge_url": judge_lb_url,
        "haproxy_stats_url": f"http://{HOSTS['lb']}:{lb_stats_port}/stats",
        "policy_replica_urls": [r.url for r in replicas],
        "judge_server_urls": [j.url for j in judges],
        "policy_engine_urls": [e.url for e in p_engines],
        "judge_engine_urls": [e.url for e in j_engines],
        "policy_router_url": p_router.url,
        "judge_router_url": j_router.url,
        "trainer": trainer_url,
        "store_url": store_url,
        "api_key": api_key,
        "admin_api_key": admin_api_key,
        "policy_model_path": str(policy_model),
        "teacher_model_path": str(teacher_model),
        "checkpoint_dir": str(run_dir / "checkpoints"),
        "log_dir": str(stack.log_dir),
    }
    shown = ("policy_url", "judge_url", "policy_router_url", "judge_router_url", "store_url")
    publish_endpoints(run_dir, endpoints, f"cluster ready in {time.monotonic() - t0:.1f}s", shown)
    return endpoints


def pg_cluster(run_dir: Path) -> PgCluster | None:
    """The PostgreSQL cluster ``start`` recorded (to restart or stop it), or None."""
    try:
        info = json.loads((run_dir / "postgres.json").read_text())
    except FileNotFoundError:
        return None
    as_user = "postgres" if os.geteuid() == 0 else None
    return PgCluster(Path(info["data_dir"]), info["port"], pg_bindir(), as_user, info["host"])


def restart_postgres(run_dir: Path) -> int:
    """``pg_ctl restart -m fast`` on the recorded cluster; records the new postmaster PID, returns it."""
    pg = pg_cluster(run_dir)
    if pg is None:
        raise RuntimeError(f"no PostgreSQL recorded in {run_dir}")
    pg.restart()
    entries = read_pids(run_dir)
    pid = pg.postmaster_pid()
    for e in entries:
        if e["name"] == "postgres":
            e["pid"], e["start_ticks"] = pid, proc_start_ticks(pid)
    write_json(run_dir / "pids.json", entries)
    return pid


def stop(run_dir: Path) -> None:
    entries = read_pids(run_dir)
    services = [e for e in entries if e["name"] != "postgres"]
    stopped = stop_entries(services)
    end = time.monotonic() + 10  # a SIGKILLed group is gone once its parent (init, here) has reaped it
    while time.monotonic() < end and any(is_ours(e) for e in services):
        time.sleep(0.1)
    pg = pg_cluster(run_dir)
    if pg is not None:
        if pg.data_dir.exists():
            pg.stop()
            stopped.append("postgres")
        (run_dir / "postgres.json").unlink(missing_ok=True)
    forget_stopped(run_dir, services, stopped)


def status(run_dir: Path) -> int:
    return devstack_status(run_dir, "cluster")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("start", "stop", "status"):
        print("usage: launch/cluster.sh start|stop|status", file=sys.stderr)
        return 2
    run_dir = run_dir_from_env()
    if args[0] == "start":
        run_dir.mkdir(parents=True, exist_ok=True)
        start(run_dir)
        return 0
    if args[0] == "stop":
        stop(run_dir)
        return 0
    return status(run_dir)


if __name__ == "__main__":
    sys.exit(main())
