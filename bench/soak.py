"""Soak: simulated users against the one-machine cluster (launch/cluster.sh) while faults happen on a schedule.

    python -m bench.soak [--duration-s 1200] [--users 6] [--weight-update-every-s 60] [--out-dir DIR]
    python -m bench.soak --short          # the suite's form: 60 s, every fault once, updates every 15 s

Starts the cluster in a run dir of its own (``launch/cluster.py start``; stopped at the end by its PID file),
then for the duration:
- Load: ``--users`` simulated users, each running sessions of 3 turns in turn over chat completions
  (``X-Session-Id``, the last turn ``X-Session-Done``), Responses and Messages, and header-less OpenClaw-shaped
  transcripts (a system prompt, tools, an earlier tool call and its result; identified by the policy server's
  session inference, closed by the idle timeout), sending explicit feedback on some answers.
- Faults, each at its point of the run (:func:`fault_schedule`): kill -9 a policy replica, a judge server and
  a judge engine (once each, not restarted: the run goes on with 2 replicas, 1 judge server, 1 judge engine) (the policy engines stay: a weight update needs every engine on the replicas' worker list);
  restart PostgreSQL (``pg_ctl restart -m fast``); a weight update (``POST /admin/weights/update`` through the
  load balancer) every ``--weight-update-every-s``, timed until every live replica reports the new version.
- Added latency: every chat turn's rendered prompt is also sent straight to the policy router's ``/generate``
  with the same sampling parameters (bench/proxy_overhead.py's method); added = through the load balancer
  and policy server minus direct, p50 / p99.

Then it drains (sessions close, judging finishes, the trainer is stopped and what is ready is leased and acked
here) and checks in the database: every answered turn recorded (``turns.response_id``), paired, judged,
each sample in exactly one lease that was not expired, at least one trainable sample held for every closed
session, 0 lost. Every failed request is explained by the fault active when it failed (else ``unexplained``).
Report: ``soak.json`` and ``soak.html`` (SVG plots: latency over time with the faults, failures by cause,
weight-version propagation) in ``--out-dir``; figures printed as it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "launch" / "cluster.py"
EXPLAIN_WINDOW_S = 20.0  # a failure this long after a fault began is that fault's
SESSION_TURNS = 3
MAX_TOKENS = 8
KINDS = ("chat", "responses", "messages", "openclaw")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} a file in the workspace",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for name in ("read", "write", "exec")
]


@dataclass
class Outcome:
    t: float  # seconds since the load began
    kind: str
    status: int  # HTTP status; 0 for a transport error
    latency_s: float
    added_s: float | None = None
    response_id: str | None = None
    error: str = ""
    cause: str = ""


@dataclass
class Soak:
    endpoints: dict[str, Any]
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    feedback: Counter = field(default_factory=Counter)
    header_sessions: set[str] = field(default_factory=set)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    think_s: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0


def say(msg: str) -> None:
    print(msg, flush=True)


# --- load ------------------------------------------------------------------------------------------


def request_for(kind: str, history: list[dict], session: str, last: bool) -> tuple[str, dict, dict]:
    """(path, headers, body) of one turn of ``kind`` continuing ``history``."""
    headers: dict[str, str] = {}
    if kind != "openclaw":
        headers["X-Session-Id"] = session
        if last:
            headers["X-Session-Done"] = "true"
    if kind == "chat":
        return (
            "/v1/chat/completions",
            headers,
            {"model": "hindsight-policy", "messages": history, "max_tokens": MAX_TOKENS},
        )
    if kind == "responses":
        return (
            "/v1/responses",
            headers,
            {"model": "hindsight-policy", "input": history, "max_output_tokens": MAX_TOKENS},
        )
    if kind == "messages":
        return "/v1/messages", headers, {"model": "hindsight-policy", "messages": history, "max_tokens": MAX_TOKENS}
    body = {"model": "hindsight-policy", "messages": history, "tools": TOOLS, "max_tokens": MAX_TOKENS}
    return "/v1/chat/completions", headers, body


def reply_text(kind: str, body: dict) -> tuple[str, str | None]:
    """The assistant's text and the response id of an answer of ``kind``."""
    if kind in ("chat", "openclaw"):
        return body["choices"][0]["message"].get("content") or "", body.get("id")
    if kind == "responses":
        parts = [
            c.get("text", "")
            for item in body.get("output", [])
            if item.get("type") == "message"
            for c in item.get("content", [])
        ]
        return "".join(parts), body.get("id")
    return "".join(c.get("text", "") for c in body.get("content", []) if c.get("type") == "text"), body.get("id")


def first_history(kind: str, user: int, n: int) -> list[dict]:
    ask = f"user {user} session {n}: please summarise the report"
    if kind != "openclaw":
        return [{"role": "user", "content": ask}]
    call = {"id": f"call_{user}_{n}", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.md"}'}}
    return [
        {"role": "system", "content": f"You are a coding agent (workspace {user}-{n}). Use the tools."},
        {"role": "user", "content": "open a.md"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "# a.md\nthe quarterly report"},
        {"role": "user", "content": ask},
    ]


async def user_loop(soak: Soak, http: httpx.AsyncClient, user: int, tokenizer: Any) -> None:
    from engine.chat import render_prompt_ids

    ep = soak.endpoints
    auth = {"Authorization": f"Bearer {ep['api_key']}"}
    n = 0
    while not soak.stop.is_set():
        kind = KINDS[(user + n) % len(KINDS)]
        session = f"soak-{user}-{n}"
        history = first_history(kind, user, n)
        for turn in range(SESSION_TURNS):
            if soak.stop.is_set():
                break
            last = turn == SESSION_TURNS - 1
            path, headers, body = request_for(kind, history, session, last)
            t_start = soak.now()
            t = time.perf_counter()
            out = Outcome(t_start, kind, 0, 0.0)
            try:
                r = await http.post(ep["policy_url"] + path, headers={**auth, **headers}, json=body)
                out.latency_s = time.perf_counter() - t
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = r.text[:200]
            except httpx.HTTPError as exc:
                out.latency_s, out.error = time.perf_counter() - t, f"{type(exc).__name__}: {exc}"[:200]
            soak.outcomes.append(out)
            if out.status != 200:
                break  # the session ends here (as an agent whose call failed would start over)
            if kind != "openclaw":
                soak.header_sessions.add(session)
            text, out.response_id = reply_text(kind, r.json())
            if kind == "chat":  # the same prompt straight to the engines: what the policy server adds
                ids = render_prompt_ids(tokenizer, history)
                t = time.perf_counter()
                try:
                    d = await http.post(
                        ep["policy_router_url"] + "/generate",
                        json={"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 1.0}},
                    )
                    if d.status_code == 200:
                        out.added_s = out.latency_s - (time.perf_counter() - t)
                except httpx.HTTPError:
                    pass
            if out.response_id and (user + n + turn) % 3 == 0:
                try:
                    fb = await http.post(
                        ep["policy_url"] + "/v1/feedback",
                        headers=auth,
                        json={"response_id": out.response_id, "value": "up" if turn % 2 else "down"},
                    )
                    soak.feedback[str(fb.status_code)] += 1
                except httpx.HTTPError as exc:
                    soak.feedback[type(exc).__name__] += 1
            await asyncio.sleep(soak.think_s)  # the user reads the answer (and the agent runs its tool)
            history = [*history, {"role": "assistant", "content": text}]
            history.append({"role": "user", "content": f"thanks; now step {turn + 2}"})
        n += 1


# --- faults ----------------------------------------------------------------------------------------


def fault_schedule(duration_s: float) -> list[tuple[float, str]]:
    """Each kill once, PostgreSQL restarts spread over the run (once in a short one)."""
    plan = [(0.2, "kill_policy_replica"), (0.35, "kill_judge_server"), (0.5, "kill_judge_engine")]
    restarts = max(1, int(duration_s // 300))
    plan += [((0.6 + 0.3 * i / restarts), "restart_postgres") for i in range(restarts)]
    return sorted((frac * duration_s, name) for frac, name in plan)


KILL_TARGETS = {
    "kill_policy_replica": "policy-2",
    "kill_judge_server": "judge-2",
    "kill_judge_engine": "judge-engine-2",
}


def kill9(run_dir: Path, name: str) -> int:
    """SIGKILL the process group of ``name`` as recorded in pids.json, if it is still the one started."""
    from launch.devstack import is_ours, read_pids

    entry = next(e for e in read_pids(run_dir) if e["name"] == name)
    if not is_ours(entry):
        raise RuntimeError(f"{name} (pid {entry['pid']}) is not running")
    os.killpg(entry["pid"], signal.SIGKILL)
    return int(entry["pid"])


async def apply_fault(soak: Soak, run_dir: Path, name: str) -> None:
    began = soak.now()
    detail: dict[str, Any] = {"fault": name, "t": began}
    if name in KILL_TARGETS:
        detail["target"] = KILL_TARGETS[name]
        detail["pid"] = kill9(run_dir, KILL_TARGETS[name])
    elif name == "restart_postgres":
        from launch.cluster import restart_postgres

        detail["pid"] = await asyncio.to_thread(restart_postgres, run_dir)
    detail["took_s"] = round(soak.now() - began, 3)
    soak.faults.append(detail)
    say(f"  t={began:6.1f}s fault {name} {detail.get('target', '')} ({detail['took_s']}s)")


async def weight_update(soak: Soak, http: httpx.AsyncClient, n: int) -> None:
    ep = soak.endpoints
    admin = {"Authorization": f"Bearer {ep['admin_api_key']}"}
    version = f"soak-{n}"
    began, t = soak.now(), time.perf_counter()
    rec: dict[str, Any] = {"t": began, "version": version}
    try:
        r = await http.post(
            ep["policy_url"] + "/admin/weights/update",
            headers=admin,
            json={"model_path": ep["policy_model_path"], "weight_version": version},
            timeout=300,
        )
        rec["status"] = r.status_code
        rec["success"] = r.status_code == 200 and bool(r.json().get("success"))
    except httpx.HTTPError as exc:
        rec["status"], rec["success"] = 0, False
        rec["error"] = type(exc).__name__
    if rec["success"]:  # until every live replica reports it (a killed one is skipped)
        deadline = time.perf_counter() + 60
        pending = set(ep["policy_replica_urls"])
        while pending and time.perf_counter() < deadline:
            for url in list(pending):
                try:
                    ready = await http.get(url + "/ready", headers=admin, timeout=2)
                    if ready.json().get("weight_version") == version:
                        pending.discard(url)
                except (httpx.HTTPError, ValueError):
                    if not await alive(http, url):
                        pending.discard(url)
            await asyncio.sleep(0.05)
        rec["all_replicas_s"] = round(time.perf_counter() - t, 3) if not pending else None
    soak.updates.append(rec)
    say(f"  t={began:6.1f}s weight update {version}: {rec.get('status')} all replicas in {rec.get('all_replicas_s')}s")


async def alive(http: httpx.AsyncClient, url: str) -> bool:
    try:
        await http.get(url + "/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


async def drive(soak: Soak, run_dir: Path, args: argparse.Namespace, tokenizer: Any) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, trust_env=False, limits=limits) as http:
        users = [asyncio.create_task(user_loop(soak, http, u, tokenizer)) for u in range(args.users)]
        schedule = fault_schedule(args.duration_s)
        next_update, n_update = args.weight_update_every_s, 0
        try:
            while soak.now() < args.duration_s:
                if schedule and soak.now() >= schedule[0][0]:
                    await apply_fault(soak, run_dir, schedule.pop(0)[1])
                if soak.now() >= next_update:
                    n_update += 1
                    await weight_update(soak, http, n_update)
                    next_update += args.weight_update_every_s
                await asyncio.sleep(0.2)
        finally:
            soak.stop.set()  # users finish their request in flight, then stop
            await asyncio.gather(*users, return_exceptions=True)


# --- checks ----------------------------------------------------------------------------------------


def explain(soak: Soak) -> None:
    """Attribute each failed request to the fault active when it was sent (or a weight update's pause)."""
    events = sorted([(f["t"], f["fault"]) for f in soak.faults] + [(u["t"], "weight_update") for u in soak.updates])
    for o in soak.outcomes:
        if o.status == 200:
            continue
        recent = [name for t, name in events if t - 1.0 <= o.t + o.latency_s and o.t <= t + EXPLAIN_WINDOW_S]
        # A fault explains a failure before a weight update does: an update is meant to cost nothing, so one that
        # shares the window with a fault (they are scheduled on the same minute) must not take the blame.
        faults = [name for name in recent if name != "weight_update"]
        o.cause = (faults or recent or ["unexplained"])[-1]


def drain_and_check(soak: Soak, run_dir: Path, idle_s: float) -> dict[str, Any]:
    import psycopg

    from launch.devstack import read_pids, stop_entries

    ep = soak.endpoints
    admin = {"Authorization": f"Bearer {ep['admin_api_key']}"}
    say("draining: sessions close, judging finishes ...")
    drain = wait_for_drain(ep["store_url"], first_s=max(120.0, 6 * idle_s))
    if drain["drained"]:
        say(f"  sessions closed and judging done at +{drain['took_s']:.1f}s")
    else:
        say(
            f"  drain gave up at +{drain['took_s']:.1f}s with {drain['open_sessions']} open sessions and "
            f"{drain['pending']} samples awaiting the judge (the backlog stopped shrinking)"
        )
    # The trainer holds partial batches: stop it, then lease what is ready here (its unacked leases expire).
    stop_entries([e for e in read_pids(run_dir) if e["name"] == "trainer"])
    leased_here = 0
    with httpx.Client(timeout=60, trust_env=False) as http:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            r = http.get(ep["policy_url"] + "/v1/samples/lease", params={"max": 64, "wait_s": 2}, headers=admin)
            lease = r.json() if r.status_code == 200 else {}
            if lease.get("samples"):
                http.post(ep["policy_url"] + "/v1/samples/ack", json={"lease_id": lease["lease_id"]}, headers=admin)
                leased_here += len(lease["samples"])
                continue
            with psycopg.connect(ep["store_url"], autocommit=True) as db:
                if db.execute("SELECT count(*) FROM samples WHERE status IN ('leased','ready')").fetchone()[0] == 0:
                    break
            time.sleep(1)
    with psycopg.connect(ep["store_url"], autocommit=True) as db:
        checks = store_checks(soak, db, leased_here)
    checks["drain"] = drain
    return checks


def wait_for_drain(store_url: str, first_s: float, stall_s: float = 60.0, cap_s: float = 1800.0) -> dict[str, Any]:
    """Wait until every session is closed and nothing awaits the judge: at least ``first_s``, then as long as the
    backlog still shrinks (a loaded judge catches up after the load stops: that is not a loss), at most ``cap_s``.
    Progress is printed every 15 s. Returns what was left and how long it took."""
    import psycopg

    start = time.monotonic()
    last_progress, best, said = start, None, start
    with psycopg.connect(store_url, autocommit=True) as db:
        while True:
            open_s = db.execute("SELECT count(*) FROM sessions WHERE done=0").fetchone()[0]
            pending = db.execute(
                "SELECT count(*) FROM samples WHERE status IN ('pending_judge','pending_score')"
            ).fetchone()[0]
            now = time.monotonic()
            if open_s == 0 and pending == 0:
                return {"drained": True, "took_s": round(now - start, 1), "open_sessions": 0, "pending": 0}
            if best is None or open_s + pending < best:
                best, last_progress = open_s + pending, now
            if now - said >= 15:
                say(f"  +{now - start:.0f}s: {open_s} sessions open, {pending} samples awaiting the judge")
                said = now
            if now - start >= cap_s or (now - start >= first_s and now - last_progress >= stall_s):
                return {"drained": False, "took_s": round(now - start, 1), "open_sessions": open_s, "pending": pending}
            time.sleep(1)


def store_checks(soak: Soak, db: Any, leased_here: int) -> dict[str, Any]:
    answered = {o.response_id for o in soak.outcomes if o.status == 200 and o.response_id}
    turns = {
        r[0]: (r[1], r[2], r[3])
        for r in db.execute(
            "SELECT response_id, session_id, turn_index, pairing FROM turns WHERE response_id IS NOT NULL"
        )
    }
    side = {r[0] for r in db.execute("SELECT record FROM side_turns")}
    recorded = {rid for rid in answered if rid in turns}
    as_side = {rid for rid in answered - recorded if any(rid in s for s in side)}
    lost = sorted(answered - recorded - as_side)
    samples = {(r[0], r[1]): r[2] for r in db.execute("SELECT session_id, turn_index, status FROM samples")}
    ours = [turns[rid] for rid in recorded]
    unpaired = [t for t in ours if t[2] == "awaiting"]
    unjudged = [t for t in ours if samples.get((t[0], t[1])) in (None, "pending_judge", "pending_score")]
    counts: Counter = Counter()
    expired = 0
    for state, ids in db.execute("SELECT state, sample_ids FROM leases"):
        if state == "expired":
            expired += 1
            continue
        counts.update(json.loads(ids))
    sample_ids = [r[0] for r in db.execute("SELECT sample_id FROM samples WHERE status IN ('leased','consumed')")]
    leased_once = sum(1 for s in sample_ids if counts[s] == 1)
    closed = [r[0] for r in db.execute("SELECT session_id FROM sessions WHERE done=1")]
    held = {
        r[0]
        for r in db.execute("SELECT DISTINCT session_id FROM samples WHERE status IN ('ready','leased','consumed')")
    }
    ours_sessions = {t[0] for t in ours}
    closed_ours = [s for s in closed if s in ours_sessions]
    # At-least-one (policy_server.rewards.modes): a closed session keeps a sample unless every turn was rejected
    # for a reason it cannot promote; a neutral ``no_signal`` rejection in a session without one is a violation.
    reasons: dict[str, list[str]] = {}
    for sid, reason in db.execute("SELECT session_id, reject_reason FROM samples WHERE status='rejected'"):
        reasons.setdefault(sid, []).append(reason or "")
    unheld = {s: sorted(set(reasons.get(s, []))) for s in closed_ours if s not in held}
    violations = sorted(s for s, rs in unheld.items() if any(r.startswith("no_signal") for r in rs))
    return {
        "answered": len(answered),
        "recorded": len(recorded) + len(as_side),
        "recorded_as_side_turns": len(as_side),
        "lost": len(lost),
        "lost_response_ids": lost[:20],
        "paired": len(ours) - len(unpaired),
        "unpaired": len(unpaired),
        "judged": len(ours) - len(unjudged),
        "unjudged": len(unjudged),
        "samples_by_status": dict(Counter(samples.values())),
        "leased_samples": len(sample_ids),
        "leased_exactly_once": leased_once,
        "leased_more_than_once": sum(1 for s in sample_ids if counts[s] > 1),
        "expired_leases": expired,
        "leased_by_soak_at_drain": leased_here,
        "closed_sessions": len(closed_ours),
        "closed_sessions_with_held_sample": len(closed_ours) - len(unheld),
        "closed_sessions_all_rejected": dict(sorted(unheld.items())[:20]),
        "at_least_one_violations": violations,
        "reject_reasons": dict(Counter(r.split(":")[0] for rs in reasons.values() for r in rs)),
        "open_sessions": db.execute("SELECT count(*) FROM sessions WHERE done=0").fetchone()[0],
    }


# --- report ----------------------------------------------------------------------------------------


def q(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(pct / 100 * (len(s) - 1))))]


def summarise(soak: Soak, checks: dict[str, Any], args: argparse.Namespace, started_s: float) -> dict[str, Any]:
    ok = [o for o in soak.outcomes if o.status == 200]
    failed = [o for o in soak.outcomes if o.status != 200]
    added = [o.added_s * 1e3 for o in ok if o.added_s is not None]
    props = [u["all_replicas_s"] for u in soak.updates if u.get("all_replicas_s") is not None]
    return {
        "duration_s": args.duration_s,
        "users": args.users,
        "cluster_start_s": round(started_s, 1),
        "requests": {
            "served": len(ok),
            "failed": len(failed),
            "by_kind": dict(Counter(o.kind for o in ok)),
            "failed_by_status": dict(Counter(str(o.status) for o in failed)),
            "failed_by_cause": dict(Counter(o.cause for o in failed)),
            "unexplained": sum(1 for o in failed if o.cause == "unexplained"),
            "latency_p50_ms": q([o.latency_s * 1e3 for o in ok], 50),
            "latency_p99_ms": q([o.latency_s * 1e3 for o in ok], 99),
        },
        "added_ms": {"p50": q(added, 50), "p99": q(added, 99), "n": len(added)},
        "feedback": dict(soak.feedback),
        "faults": soak.faults,
        "weight_updates": soak.updates,
        "weight_version_all_replicas_s": {"p50": q(props, 50), "max": max(props) if props else None, "n": len(props)},
        "store": checks,
    }


def write_html(path: Path, report: dict[str, Any], soak: Soak) -> None:
    from trainer.report.svg import bar_chart, line_chart

    ok = [o for o in soak.outcomes if o.status == 200]
    lat = {"latency (ms)": [(o.t, o.latency_s * 1e3) for o in ok]}
    lat["added (ms)"] = [(o.t, o.added_s * 1e3) for o in ok if o.added_s is not None]
    causes = sorted(report["requests"]["failed_by_cause"])
    plots = [
        line_chart("Latency through the load balancer, and what the policy server adds", lat, x_label="t (s)"),
        bar_chart(
            "Failed requests by cause",
            causes or ["none"],
            {"failed": [report["requests"]["failed_by_cause"].get(c, 0) for c in causes] or [0]},
        ),
        line_chart(
            "Time for every replica to reach a new weight version",
            {"s": [(u["t"], u["all_replicas_s"]) for u in soak.updates if u.get("all_replicas_s") is not None]},
            x_label="t (s)",
        ),
    ]
    faults = "".join(f"<li>t={f['t']:.1f}s {f['fault']} {f.get('target', '')}</li>" for f in soak.faults)
    body = json.dumps(
        {k: report[k] for k in ("requests", "added_ms", "store", "weight_version_all_replicas_s")}, indent=2
    )
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>Hindsight soak</title><h1>Hindsight soak</h1>"
        f"<p>{report['duration_s']} s, {report['users']} users.</p><ul>{faults}</ul>"
        + "".join(f"<div>{p}</div>" for p in plots)
        + f"<pre>{body}</pre>"
    )


# --- main ------------------------------------------------------------------------------------------


def cluster(run_dir: Path, command: str, env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, str(CLUSTER), command], env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"launch/cluster.py {command} failed ({done.returncode})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=1200)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--weight-update-every-s", type=float, default=60)
    parser.add_argument("--session-idle-s", type=float, default=8)
    parser.add_argument("--dispatch-claim-s", type=float, default=10)
    parser.add_argument("--think-s", type=float, default=0.5, help="a user's pause between an answer and its next turn")
    parser.add_argument("--short", action="store_true", help="60 s, every fault once, weight updates every 15 s")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.short:
        args.duration_s, args.weight_update_every_s, args.users = 60, 15, 4
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="hindsight-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir / "cluster"
    env = {
        **os.environ,
        "HINDSIGHT_RUN_DIR": str(run_dir),
        "HINDSIGHT_CLUSTER_SESSION_IDLE_TIMEOUT_S": str(args.session_idle_s),
        # The soak pushes the weight updates (every --weight-update-every-s); the trainer only leases and trains.
        "HINDSIGHT_CLUSTER_TRAINER_ARGS": "--no-weight-sync",
        # A killed replica's judge work goes to another replica after this (default 30 s): the drain waits for it.
        "HINDSIGHT_POLICY_DISPATCH_CLAIM_S": str(args.dispatch_claim_s),
    }
    say(f"starting the cluster in {run_dir} ...")
    t = time.monotonic()
    cluster(run_dir, "start", env)
    started_s = time.monotonic() - t
    try:
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        from engine.chat import load_tokenizer

        tokenizer = load_tokenizer(endpoints["policy_model_path"])
        say(f"load: {args.users} users for {args.duration_s:.0f}s; faults {fault_schedule(args.duration_s)}")
        soak = Soak(endpoints, think_s=args.think_s)
        asyncio.run(drive(soak, run_dir, args, tokenizer))
        explain(soak)
        t = time.monotonic()
        checks = drain_and_check(soak, run_dir, args.session_idle_s)
        checks["drain_s"] = round(time.monotonic() - t, 1)
        say(f"drained and checked in {checks['drain_s']}s")
    finally:
        from launch.devstack import is_ours, read_pids

        entries = read_pids(run_dir)
        t = time.monotonic()
        cluster(run_dir, "stop", env)
        say(f"cluster stopped in {time.monotonic() - t:.1f}s")
    report = summarise(soak, checks, args, started_s)
    # What the cluster ran (name, host, pid) and what of it outlived its stop (must be nothing).
    report["cluster"] = [{"name": e["name"], "url": e["url"], "pid": e["pid"]} for e in entries]
    report["cluster_left_running"] = [e["name"] for e in entries if is_ours(e)]
    report["outcomes"] = [asdict(o) for o in soak.outcomes]
    (out_dir / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    write_html(out_dir / "soak.html", report, soak)
    r, s = report["requests"], report["store"]
    say(
        f"served {r['served']} failed {r['failed']} {r['failed_by_cause']} unexplained {r['unexplained']}; "
        f"added p50 {report['added_ms']['p50']} ms p99 {report['added_ms']['p99']} ms"
    )
    say(
        f"answered {s['answered']} recorded {s['recorded']} lost {s['lost']} paired {s['paired']} judged {s['judged']} "
        f"leased once {s['leased_exactly_once']}/{s['leased_samples']}; "
        f"weight version on all replicas {report['weight_version_all_replicas_s']}"
    )
    say(f"report: {out_dir / 'soak.json'} and {out_dir / 'soak.html'}")
    return report


if __name__ == "__main__":
    main()
