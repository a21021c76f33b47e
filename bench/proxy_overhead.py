"""Proxy overhead of the policy server: the same requests direct to the engine's /generate vs. through
``/v1/chat/completions`` of the policy server (render + record + SQLite commit + parse), at concurrency 1
and 32. Prints mean/p50/p95 latency per path and the latency ratio (policy / direct).

    python bench/proxy_overhead.py [--model-dir DIR] [--requests 64] [--max-tokens 16]

Starts a dev engine and a policy server on 127.0.0.1 ephemeral ports (stopped by PID at the end); builds
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "policy"))

from engine.chat import load_tokenizer, render_prompt_ids  # noqa: E402
from engine.procs import start_dev_engine  # noqa: E402
from policy_testkit import CLIENT_KEY, start_policy  # noqa: E402


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
            r = await http.post(engine_url + "/generate", json={"input_ids": ids[i], "sampling_params":
                                                                 dict(sp, sampling_seed=i), "return_logprob": True})
            r.raise_for_status()

        async def proxied(i: int) -> None:
            r = await http.post(policy_url + "/v1/chat/completions", headers={
                "Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": f"bench-{i}", "X-Turn-Type": "main"},
                json={"messages": prompts[i], "max_tokens": max_tokens, "temperature": 1.0, "seed": i})
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
            print(f"concurrency {conc:2d}  direct : {_fmt(d)}")  # noqa: T201
            print(f"concurrency {conc:2d}  policy : {_fmt(p)}")  # noqa: T201
            print(f"concurrency {conc:2d}  overhead per request: mean {(statistics.mean(p) - statistics.mean(d)) * 1e3:+.1f} ms"  # noqa: T201
                  f"  p50 {(statistics.median(p) - statistics.median(d)) * 1e3:+.1f} ms")
            print(f"concurrency {conc:2d}  latency ratio policy/direct (mean) = "  # noqa: T201
                  f"{statistics.mean(p) / statistics.mean(d):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = Path(args.model_dir) if args.model_dir else None
        if model is None:
            from engine.tiny_model import build_tiny_model

            model = build_tiny_model(work / "model")
        eng = start_dev_engine(model, log_dir=work)
        pol = None
        try:
            pol = start_policy(model, eng.url, work / "data", work)
            asyncio.run(bench(eng.url, pol.url, load_tokenizer(str(model)), args.requests, args.max_tokens))
        finally:
            if pol:
                pol.stop()
            eng.stop()


if __name__ == "__main__":
    main()
