"""Proxy overhead of the policy server: the same requests direct to the engine's /generate vs. through
``/v1/chat/completions`` of the policy server (render + record + SQLite commit + parse).

    python -m bench.proxy_overhead [--model-dir DIR] [--requests 64] [--max-tokens 16] [--stub-turns 8]
                                   [--engine both|stub|dev|agent] [--agent-turns 10]

Part 1 (``stub``): against bench/instant_engine.py, an engine that answers a canned /generate at once, so
the numbers are the proxy's own cost (on the dev engine the tiny model's queueing at 2 cores dominates and
can even make the proxy look "faster"). 32 simulated users each run ``--stub-turns`` continuing turns of
their own session (pairing + one store commit per turn). Printed: added latency (policy - direct) at p50 and
p99 at concurrency 1 and 32, the policy server's sustained recorded turns/s at concurrency 32, and its CPU
ms per recorded turn (its process's user+system time from /proc over that run).
Part 1b (``agent``, also in ``stub``/``both``): one header-less agent session at an agent's real prompt size,
against the instant engine: a system prompt plus 12 tool schemas of about 1k and about 30k tokens (OpenClaw's
default prompt is about 32k with this tokenizer), ``--agent-turns`` continuing turns identified by
``prompt_cache_key`` as OpenClaw sends it. Printed per size: the policy server's time per turn (policy - direct,
p50 and mean): validation, rendering the whole prompt, session resolution, pairing and the record commit.
Part 2 (``dev``): the same comparison on the CPU dev engine (mean/p50/p95 and the latency ratio).

Starts the engines and policy servers on 127.0.0.1 ephemeral ports (stopped by PID at the end); builds
the tiny model in a temp dir when --model-dir is not given.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.proc_cpu import process_cpu_s
from devkit.tiny_model import build_tiny_model
from engine.chat import load_tokenizer, render_prompt_ids
from tests.testkit.procs import ManagedProcess, free_port, start_dev_engine, start_process
from tests.testkit.servers import CLIENT_KEY, start_policy

ROUNDS = 4


async def _run(n: int, conc: int, call) -> list[float]:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            await call(i)
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(i) for i in range(n)))
    return lat


def _fmt(lat: list[float]) -> str:
    q = statistics.quantiles(lat, n=20)
    return f"mean {statistics.mean(lat) * 1e3:7.1f} ms  p50 {statistics.median(lat) * 1e3:7.1f}  p95 {q[18] * 1e3:7.1f}"


async def bench(engine_url: str, policy_url: str, tokenizer, n: int, max_tokens: int) -> None:
    prompts = [[{"role": "user", "content": f"request number {i}: tell me about the weather"}] for i in range(n)]
    ids = [render_prompt_ids(tokenizer, p) for p in prompts]
    sp = {"max_new_tokens": max_tokens, "temperature": 1.0}
    async with httpx.AsyncClient(timeout=300, trust_env=False, limits=httpx.Limits(max_connections=64)) as http:

        async def direct(i: int) -> None:
            r = await http.post(
                engine_url + "/generate",
                json={"input_ids": ids[i], "sampling_params": dict(sp, sampling_seed=i), "return_logprob": True},
            )
            r.raise_for_status()

        async def proxied(i: int) -> None:
            r = await http.post(
                policy_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": f"bench-{i}", "X-Turn-Type": "main"},
                json={"messages": prompts[i], "max_tokens": max_tokens, "temperature": 1.0, "seed": i},
            )
            r.raise_for_status()

        await _run(4, 4, direct)  # warm-up
        await _run(4, 4, proxied)
        for conc in (1, 32):
            # Alternate the two paths in rounds so drifting load on a shared machine hits both alike.
            d: list[float] = []
            p: list[float] = []
            rounds = max(1, min(ROUNDS, n // conc))  # a round keeps at least `conc` requests in flight
            for _ in range(rounds):
                d += await _run(n // rounds, conc, direct)
                p += await _run(n // rounds, conc, proxied)
            print(f"concurrency {conc:2d}  direct : {_fmt(d)}")
            print(f"concurrency {conc:2d}  policy : {_fmt(p)}")
            print(
                f"concurrency {conc:2d}  overhead per request: mean {(statistics.mean(p) - statistics.mean(d)) * 1e3:+.1f} ms"
                f"  p50 {(statistics.median(p) - statistics.median(d)) * 1e3:+.1f} ms"
            )
            print(
                f"concurrency {conc:2d}  latency ratio policy/direct (mean) = "
                f"{statistics.mean(p) / statistics.mean(d):.3f}"
            )


def start_instant_engine(tokenizer, log_dir: Path) -> ManagedProcess:
    reply = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    port = free_port()
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("instant_engine.py")),
        "--port",
        str(port),
        "--output-ids",
        ",".join(str(t) for t in reply),
        "--text",
        "ok",
    ]
    return start_process("instant-engine", cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir, deadline_s=30)


def _q(lat: list[float], pct: int) -> float:
    return statistics.quantiles(lat, n=100)[pct - 1]


async def bench_stub(engine_url: str, policy: ManagedProcess, tokenizer, turns_per_user: int) -> None:
    users = 32
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=httpx.Limits(max_connections=64)) as http:

        async def direct(ids: list[int]) -> None:
            r = await http.post(
                engine_url + "/generate",
                json={
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
                    "return_logprob": True,
                },
            )
            r.raise_for_status()

        async def proxied(sid: str, messages: list[dict]) -> dict:
            r = await http.post(
                policy.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": sid, "X-Turn-Type": "main"},
                json={"messages": messages, "max_tokens": 16, "temperature": 1.0},
            )
            r.raise_for_status()
            return r.json()["choices"][0]["message"]

        async def user(tag: str, conc_sem: asyncio.Semaphore, d: list[float], p: list[float]) -> None:
            messages = [{"role": "user", "content": f"{tag}: tell me about the weather"}]
            for t in range(turns_per_user):
                ids = render_prompt_ids(tokenizer, messages)  # the client's own work stays outside the timing
                async with conc_sem:
                    t0 = time.perf_counter()
                    await direct(ids)
                    d.append(time.perf_counter() - t0)
                async with conc_sem:
                    t0 = time.perf_counter()
                    reply = await proxied(tag, messages)
                    p.append(time.perf_counter() - t0)
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply.get("content") or ""},
                    {"role": "user", "content": f"and turn {t + 1}?"},
                ]

        await asyncio.gather(*(user(f"warm-{i}", asyncio.Semaphore(4), [], []) for i in range(4)))
        print(f"# part 1: instant engine stub, {users} users x {turns_per_user} continuing turns")
        for conc in (1, 32):
            sem = asyncio.Semaphore(conc)
            d: list[float] = []
            p: list[float] = []
            await asyncio.gather(*(user(f"c{conc}-u{i}", sem, d, p) for i in range(users)))
            print(
                f"concurrency {conc:2d}  added latency policy - direct: p50 {(_q(p, 50) - _q(d, 50)) * 1e3:+.2f} ms  "
                f"p99 {(_q(p, 99) - _q(d, 99)) * 1e3:+.2f} ms   (direct p50 {_q(d, 50) * 1e3:.2f} ms, "
                f"policy p50 {_q(p, 50) * 1e3:.2f} ms, p99 {_q(p, 99) * 1e3:.2f} ms)"
            )

        async def proxied_only(tag: str) -> None:
            messages = [{"role": "user", "content": f"{tag}: tell me about the weather"}]
            for t in range(turns_per_user):
                reply = await proxied(tag, messages)
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply.get("content") or ""},
                    {"role": "user", "content": f"and turn {t + 1}?"},
                ]

        cpu0, t0 = process_cpu_s(policy.pid), time.perf_counter()
        await asyncio.gather(*(proxied_only(f"load-u{i}") for i in range(users)))
        wall, cpu = time.perf_counter() - t0, process_cpu_s(policy.pid) - cpu0
        n = users * turns_per_user
        print(
            f"concurrency 32  sustained: {n / wall:.1f} recorded turns/s, "
            f"{cpu * 1e3 / n:.2f} CPU ms per recorded turn (policy server process)"
        )


AGENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"tool number {i}: reads, writes or searches files for the user",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for i in range(12)
]


def agent_system_prompt(tokenizer, target_tokens: int) -> str:
    """A system prompt whose render with AGENT_TOOLS is about ``target_tokens`` tokens."""
    unit = "You are a helpful agent. Use the tools to read and write files, then answer the user. "
    base = len(render_prompt_ids(tokenizer, [{"role": "system", "content": unit}], AGENT_TOOLS))
    per_unit = max(1, len(render_prompt_ids(tokenizer, [{"role": "system", "content": unit * 20}], AGENT_TOOLS)) - base)
    return unit * max(1, round(20 * (target_tokens - base) / per_unit))


async def bench_agent(engine_url: str, policy: ManagedProcess, tokenizer, turns: int) -> None:
    print(f"# part 1b: one header-less agent session (prompt_cache_key), {turns} turns, instant engine")
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        for target in (1000, 30000):
            system = agent_system_prompt(tokenizer, target)
            messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
            added: list[float] = []
            size = 0
            for t in range(turns):
                ids = render_prompt_ids(tokenizer, messages, AGENT_TOOLS)  # the client's work, outside the timing
                size = len(ids)
                t0 = time.perf_counter()
                r = await http.post(
                    engine_url + "/generate",
                    json={
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
                        "return_logprob": True,
                    },
                )
                r.raise_for_status()
                direct = time.perf_counter() - t0
                t0 = time.perf_counter()
                r = await http.post(
                    policy.url + "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                    json={
                        "messages": messages,
                        "tools": AGENT_TOOLS,
                        "max_tokens": 16,
                        "prompt_cache_key": f"agent-{target}",
                    },
                )
                r.raise_for_status()
                added.append(time.perf_counter() - t0 - direct)
                reply = r.json()["choices"][0]["message"]
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply.get("content") or ""},
                    {"role": "user", "content": f"and turn {t + 1}?"},
                ]
            print(
                f"prompt ~{size:6d} tokens  policy server time per turn: p50 {statistics.median(added) * 1e3:8.1f} ms  "
                f"mean {statistics.mean(added) * 1e3:8.1f} ms  (over {turns} turns)"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stub-turns", type=int, default=8, help="continuing turns per simulated user (stub part)")
    ap.add_argument("--engine", choices=["both", "stub", "dev", "agent"], default="both")
    ap.add_argument("--agent-turns", type=int, default=10, help="turns of the agent-size session (stub part)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # 64k tokens of context: the agent part's 30k-token prompt must pass the server's context check
        model = (
            Path(args.model_dir) if args.model_dir else build_tiny_model(work / "model", max_position_embeddings=65536)
        )
        tok = load_tokenizer(str(model))
        if args.engine in ("both", "stub", "agent"):
            eng = start_instant_engine(tok, work)
            pol = None
            try:
                pol = start_policy(model, eng.url, work / "data-stub", work, name="policy-stub")
                if args.engine != "agent":
                    asyncio.run(bench_stub(eng.url, pol, tok, args.stub_turns))
                asyncio.run(bench_agent(eng.url, pol, tok, args.agent_turns))
            finally:
                if pol:
                    pol.stop()
                eng.stop()
        if args.engine in ("both", "dev"):
            print("# part 2: CPU dev engine (tiny model)")
            eng = start_dev_engine(model, log_dir=work)
            pol = None
            try:
                pol = start_policy(model, eng.url, work / "data", work)
                asyncio.run(bench(eng.url, pol.url, tok, args.requests, args.max_tokens))
            finally:
                if pol:
                    pol.stop()
                eng.stop()


if __name__ == "__main__":
    main()
