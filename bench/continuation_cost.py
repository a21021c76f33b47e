"""Policy-server cost of a continuing turn at growing history lengths, against an instant engine.

    python -m bench.continuation_cost [--model-dir DIR] [--sizes 1000,10000,30000] [--sessions 4] [--turns 8] [--rounds 3]
        [--chat-template FILE] [--history sampled|template]

In each of ``--rounds`` rounds, for each history size H (tokens of the tiny policy tokenizer)
``--sessions`` sessions open with one turn carrying an H-token history (a full render), then run
``--turns`` continuing turns one at a time (the reply, then a short user message), the sizes interleaved
turn by turn so that load from other jobs on the machine falls on every size alike. Only the continuing
turns are measured: the policy server's CPU ms per turn (the time its threads spent on a CPU over each
turn, in nanoseconds from /proc's schedstat: bench.proc_cpu.ThreadCpu, not 10 ms ticks) and the client-seen
latency (p50). Printed: each round's CPU per size and its 30k/1k ratio, the median ratio over the rounds
(the target is <= 1.5x) and, for scale, what the template's full render + tokenization of the same history
costs in this process (what every turn cost before prompts became token-continuous).
bench/instant_engine.py answers /generate at once, so the figures are the policy server's own; its prompt
renders by reason come from its /metrics.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.proc_cpu import ThreadCpu
from bench.proxy_overhead import start_instant_engine
from devkit.tiny_model import build_tiny_model
from engine.chat import load_tokenizer, render_prompt_ids
from tests.long_context import long_context
from tests.testkit.servers import CLIENT_KEY, start_policy


def _renders(policy_url: str) -> dict[str, float]:
    text = httpx.get(policy_url + "/metrics", trust_env=False, timeout=10).text
    return {
        m[0]: float(m[1])
        for m in re.findall(r'^hindsight_policy_prompt_renders_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    }


class _Session:
    """One benchmark session: its history (growing by a reply and a short user message per turn)."""

    def __init__(self, http: httpx.Client, tok, size: int, index: int) -> None:
        history, _ = long_context(tok, size, random.Random(size * 100 + index), tag=f"s{size}-{index}")
        self.history = [{"role": "system", "content": "You manage files."}, *history]
        if self.history[-1]["role"] != "user":
            self.history.append({"role": "user", "content": "go"})
        self.http, self.turns = http, 0
        sid = f"cost-{size}-{index}-{time.monotonic_ns()}"
        self.headers = {"Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": sid}
        self.reply = self._post()  # the opening turn: a full render of the whole history (not measured)

    def _post(self) -> dict:
        r = self.http.post(
            "/v1/chat/completions", json={"messages": self.history, "max_tokens": 4}, headers=self.headers
        )
        r.raise_for_status()
        return r.json()["choices"][0]["message"]

    def next_turn(self) -> None:
        """One continuing turn: the previous reply, then a short user message."""
        self.history = [*self.history, {"role": "assistant", "content": self.reply.get("content") or ""}]
        self.history.append({"role": "user", "content": f"next step {self.turns}: check the output"})
        self.turns += 1
        self.reply = self._post()


def run_round(
    http: httpx.Client, cpu_of: ThreadCpu, tok, sizes: list[int], sessions: int, turns: int
) -> dict[int, dict]:
    """One round: ``sessions`` sessions per size, then ``turns`` continuing turns each, the sizes interleaved
    turn by turn (load from other jobs on the machine then falls on every size alike)."""
    open_ = {size: [_Session(http, tok, size, s) for s in range(sessions)] for size in sizes}
    cpu = dict.fromkeys(sizes, 0.0)
    lat: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(turns):
        for s in range(sessions):
            for size in sizes:
                c0, t0 = cpu_of.read(), time.perf_counter()
                open_[size][s].next_turn()
                lat[size].append(time.perf_counter() - t0)
                cpu[size] += cpu_of.since(c0)
    n = sessions * turns
    return {size: {"cpu_ms": cpu[size] / n * 1e3, "p50_ms": statistics.median(lat[size]) * 1e3} for size in sizes}


def _rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def full_render_ms(tok, size: int) -> tuple[float, int]:
    """For scale: the template's full render + tokenization of a history of that size (ms, tokens)."""
    msgs = [{"role": "system", "content": "You manage files."}, *long_context(tok, size, random.Random(1))[0]]
    t0 = time.perf_counter()
    ids = render_prompt_ids(tok, msgs)
    return (time.perf_counter() - t0) * 1e3, len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--sizes", default="1000,10000,30000")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the ratio printed last is their median")
    ap.add_argument("--chat-template", type=Path, help="serve this chat template (the policy's --chat-template)")
    ap.add_argument("--history", default="sampled", choices=("sampled", "template"), help="the policy's --history")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hs-contcost-"))
    model_dir = a.model_dir or build_tiny_model(work / "tiny", seed=0)
    tok = load_tokenizer(str(model_dir))
    eng = start_instant_engine(tok, work)
    chosen = ["--history", a.history]
    if a.chat_template is not None:
        tok.chat_template = a.chat_template.read_text()  # the full render for scale uses it too
        chosen += ["--chat-template", str(a.chat_template)]
    pol = start_policy(
        model_dir,
        eng.url,
        work / "data",
        work,
        extra=[
            "--max-body-bytes",
            str(64 << 20),
            "--session-idle-timeout-s",
            "600",
            "--max-prompt-tokens",
            "1000000",
            *chosen,
        ],
    )
    try:
        with httpx.Client(base_url=pol.url, timeout=120, trust_env=False) as http:
            cpu_of = ThreadCpu(pol.pid)
            if not cpu_of.exact:
                print("no schedstat in /proc: CPU read in clock ticks (10 ms), so single rounds swing widely")
            run_round(http, cpu_of, tok, [sizes[0]], 1, 2)  # warm-up
            before = _renders(pol.url)
            lo, hi = min(sizes), max(sizes)
            ratios, cpu_by_size = [], {size: [] for size in sizes}
            for k in range(a.rounds):
                results = run_round(http, cpu_of, tok, sizes, a.sessions, a.turns)
                for size in sizes:
                    cpu_by_size[size].append(results[size]["cpu_ms"])
                # A round that measured no CPU at the small size (ticks, on a coarse clock) has no ratio.
                ratios.append(results[hi]["cpu_ms"] / results[lo]["cpu_ms"] if results[lo]["cpu_ms"] > 0 else math.inf)
                print(
                    f"round {k + 1}: "
                    + "  ".join(
                        f"{size // 1000}k {r['cpu_ms']:5.1f} ms CPU (p50 {r['p50_ms']:5.1f} ms)"
                        for size, r in results.items()
                    )
                    + f"  ratio {hi}/{lo} = {ratios[-1]:.2f}x  policy RSS {_rss_mb(pol.pid):.0f} MB"
                )
            after = _renders(pol.url)
            print("prompt renders by reason:", {k: after.get(k, 0) - before.get(k, 0) for k in after})
            for size in sizes:
                ms, tokens = full_render_ms(tok, size)
                print(
                    f"history {size:6d} tokens ({tokens:6d} rendered): policy CPU per continuing turn, median of "
                    f"rounds {statistics.median(cpu_by_size[size]):5.1f} ms | a full render of it alone: {ms:6.1f} ms"
                )
            print(
                f"CPU per continuing turn {hi}/{lo} tokens ratio: median {statistics.median(ratios):.2f}x over "
                f"{a.rounds} rounds (each {a.sessions} sessions x {a.turns} turns per size; target <= 1.5x)"
            )
    finally:
        pol.stop()
        eng.stop()


if __name__ == "__main__":
    main()
