"""Bench: chat latency seen by clients during a weight update vs steady state, and failed requests.

Run:  python -m bench.weight_sync_pause [--clients 4] [--steady-s 6] [--updates 3] [--pause-mode retract]

One CPU dev engine (tiny model) behind a policy server on 127.0.0.1 ephemeral ports. ``--clients`` users send
main chat turns (16 new tokens, half of them streamed) back to back. First ``--steady-s`` seconds of steady
load; then ``--updates`` times POST /admin/weights/update (pause -> update_weights_from_disk -> continue on the
engine), 2 s apart, under the same load. A request counts as "during an update" when its lifetime overlaps an
update call. Printed, side by side in one run: p50/p99 latency steady vs during, the p99 ratio (goal <= 2x)
and failed requests (goal 0: any non-200, error body, or transport error).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from devkit.tiny_model import build_tiny_model
from tests.testkit.procs import start_dev_engine
from tests.testkit.servers import ADMIN_KEY, CLIENT_KEY, start_policy


def _q(lat: list[float], pct: int) -> float:
    return statistics.quantiles(lat, n=100)[pct - 1] if len(lat) > 1 else (lat[0] if lat else float("nan"))


async def run(policy_url: str, model_dir: Path, clients: int, steady_s: float, updates: int) -> None:
    done: list[tuple[float, float]] = []  # (start, end) of each successful request
    failures: list[str] = []
    windows: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def user(i: int, http: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {
                "messages": [{"role": "user", "content": f"user {i} request {n}: tell me about the weather"}],
                "max_tokens": 16,
                "temperature": 1.0,
                "stream": n % 2 == 0,
            }
            t0 = time.monotonic()
            try:
                r = await http.post(
                    policy_url + "/v1/chat/completions",
                    json=body,
                    headers={
                        "Authorization": f"Bearer {CLIENT_KEY}",
                        "X-Session-Id": f"u{i}-{n}",
                        "X-Session-Done": "1",
                    },
                )
                if r.status_code != 200 or '"error"' in r.text:
                    failures.append(f"{r.status_code} {r.text[:120]}")
                    continue
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
                continue
            done.append((t0, time.monotonic()))

    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        tasks = [asyncio.create_task(user(i, http)) for i in range(clients)]
        await asyncio.sleep(1.0)  # warm-up, not measured
        t_steady = time.monotonic()
        await asyncio.sleep(steady_s)
        t_steady_end = time.monotonic()
        for k in range(updates):
            t0 = time.monotonic()
            r = await http.post(
                policy_url + "/admin/weights/update",
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                json={"model_path": str(model_dir), "weight_version": f"v{k + 1}"},
            )
            windows.append((t0, time.monotonic()))
            if r.status_code != 200 or not r.json().get("success"):
                failures.append(f"update {k + 1}: {r.status_code} {r.text[:120]}")
            await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks)
    steady = [e - s for s, e in done if s >= t_steady and e <= t_steady_end]
    during = [e - s for s, e in done if any(s < we and e > ws for ws, we in windows)]
    pause_s = [we - ws for ws, we in windows]
    print(
        f"# weight update under load: {clients} clients, {updates} updates "
        f"(update call {statistics.mean(pause_s) * 1e3:.0f} ms mean)"
    )
    print(f"steady : {len(steady):4d} requests  p50 {_q(steady, 50) * 1e3:7.0f} ms  p99 {_q(steady, 99) * 1e3:7.0f} ms")
    print(f"update : {len(during):4d} requests  p50 {_q(during, 50) * 1e3:7.0f} ms  p99 {_q(during, 99) * 1e3:7.0f} ms")
    ratio = _q(during, 99) / _q(steady, 99)
    print(f"p99 ratio update/steady = {ratio:.2f}x (goal <= 2x); failed requests: {len(failures)} (goal 0)")
    for f in failures[:5]:
        print(f"  failure: {f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steady-s", type=float, default=6.0)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--pause-mode", choices=["abort", "retract", "in_place"], default="retract")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = Path(args.model_dir) if args.model_dir else build_tiny_model(work / "model")
        eng = start_dev_engine(model, log_dir=work)
        pol = None
        try:
            pol = start_policy(model, eng.url, work / "data", work, extra=["--pause-mode", args.pause_mode])
            asyncio.run(run(pol.url, model, args.clients, args.steady_s, args.updates))
        finally:
            if pol:
                pol.stop()
            eng.stop()


if __name__ == "__main__":
    main()
