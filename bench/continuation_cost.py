"""Policy-server cost of a continuing turn at growing history lengths, against an instant engine.

    python -m bench.continuation_cost [--model-dir DIR] [--sizes 1000,10000,30000] [--sessions 4] [--turns 8]

For each history size H (tokens of the tiny policy tokenizer) ``--sessions`` sessions each open with one
turn carrying an H-token history (a full render), then run ``--turns`` continuing turns one at a time (the
reply, then a short user message). Only the continuing turns are measured: the policy server's CPU ms per
turn (user + system time of its process from /proc over those turns) and the client-seen latency (p50).
Printed: one line per size, the 30k/1k CPU ratio (the target is <= 1.5x) and, for scale, what the
template's full render + tokenization of the same history costs in this process (what every turn cost
before prompts became token-continuous). bench/instant_engine.py answers /generate at once, so the figures
are the policy server's own; its prompt renders by reason come from its /metrics.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.proxy_overhead import _cpu_s, start_instant_engine
from engine.chat import load_tokenizer, render_prompt_ids
from engine.tiny_model import build_tiny_model
from tests.long_context import long_context
from tests.testkit.servers import CLIENT_KEY, start_policy


def _renders(policy_url: str) -> dict[str, float]:
    text = httpx.get(policy_url + "/metrics", trust_env=False, timeout=10).text
    return {
        m[0]: float(m[1])
        for m in re.findall(r'^hindsight_policy_prompt_renders_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    }


def run_size(http: httpx.Client, policy_url: str, pid: int, tok, size: int, sessions: int, turns: int) -> dict:
    cpu = 0.0
    lat: list[float] = []
    for s in range(sessions):
        history, _ = long_context(tok, size, random.Random(size * 100 + s), tag=f"s{size}-{s}")
        history = [{"role": "system", "content": "You manage files."}, *history]
        if history[-1]["role"] != "user":
            history.append({"role": "user", "content": "go"})
        sid = f"cost-{size}-{s}-{time.monotonic_ns()}"
        headers = {"Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": sid}

        def turn(msgs: list[dict], headers: dict[str, str] = headers) -> dict:
            r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}, headers=headers)
            r.raise_for_status()
            return r.json()["choices"][0]["message"]

        reply = turn(history)  # the opening turn: a full render of the whole history (not measured)
        for t in range(turns):
            history = [*history, {"role": "assistant", "content": reply.get("content") or ""}]
            history.append({"role": "user", "content": f"next step {t}: check the output"})
            c0, t0 = _cpu_s(pid), time.perf_counter()
            reply = turn(history)
            lat.append(time.perf_counter() - t0)
            cpu += _cpu_s(pid) - c0
    n = sessions * turns
    msgs = [{"role": "system", "content": "You manage files."}, *long_context(tok, size, random.Random(1))[0]]
    t0 = time.perf_counter()
    ids = render_prompt_ids(tok, msgs)
    full_ms = (time.perf_counter() - t0) * 1e3
    return {
        "cpu_ms": cpu / n * 1e3,
        "p50_ms": statistics.median(lat) * 1e3,
        "full_render_ms": full_ms,
        "tokens": len(ids),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--sizes", default="1000,10000,30000")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hs-contcost-"))
    model_dir = a.model_dir or build_tiny_model(work / "tiny", seed=0)
    tok = load_tokenizer(str(model_dir))
    eng = start_instant_engine(tok, work)
    pol = start_policy(
        model_dir,
        eng.url,
        work / "data",
        work,
        extra=["--max-body-bytes", str(64 << 20), "--session-idle-timeout-s", "600", "--max-prompt-tokens", "1000000"],
    )
    try:
        with httpx.Client(base_url=pol.url, timeout=120, trust_env=False) as http:
            run_size(http, pol.url, pol.pid, tok, 1000, 1, 2)  # warm-up
            before = _renders(pol.url)
            results = {}
            for size in [int(x) for x in a.sizes.split(",")]:
                results[size] = r = run_size(http, pol.url, pol.pid, tok, size, a.sessions, a.turns)
                print(
                    f"history {size:6d} tokens ({r['tokens']:6d} rendered): policy CPU {r['cpu_ms']:6.1f} ms/turn  "
                    f"latency p50 {r['p50_ms']:6.1f} ms  | a full render of it alone: {r['full_render_ms']:6.1f} ms"
                )
            after = _renders(pol.url)
            print("prompt renders by reason:", {k: after.get(k, 0) - before.get(k, 0) for k in after})
            lo, hi = min(results), max(results)
            print(
                f"CPU per continuing turn {hi}/{lo} tokens ratio = {results[hi]['cpu_ms'] / results[lo]['cpu_ms']:.2f}x "
                f"(latency p50 ratio {results[hi]['p50_ms'] / results[lo]['p50_ms']:.2f}x)"
            )
    finally:
        pol.stop()
        eng.stop()


if __name__ == "__main__":
    main()
