"""Bench: judged turns/s with two CPU dev engines behind sglang-router vs one.

Run:  python -m bench.judge_scaleout [--items 12] [--concurrency 8] [--m 3] [--policy cache_aware]

Each dev engine runs one torch thread and is pinned (sched_setaffinity) to its own core, so two engines have
twice the compute of one (on a machine with fewer than two usable cores both land on the same core and the
ratio says so). Both configurations go through the real sglang-router (``--policy``, default cache_aware, so
an item's shared-prefix prefill and its task calls land on the same worker), with the judge core in-process
(judge_server.judge.JudgeService, PRM + hint, m votes, 16 new tokens). Printed, measured side by side in one
run: judged items/s for 1 and 2 engines and the ratio (ideal 2.0x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path


def make_item(i: int) -> dict:
    return {
        "context": [{"role": "user", "content": f"[item {i}] Please rename report.txt to summary.txt in ~/docs."}],
        "response": {"content": "Renamed it.", "tool_calls": [{"function": {"name": "mv", "arguments": "{}"}}]},
        "next_state": [{"role": "user", "content": "No, that is the wrong folder; use ~/work."}],
        "tasks": ["prm", "hint"],
    }


async def judged_per_s(router_url: str, model_dir: Path, items: int, concurrency: int, m: int) -> float:
    from engine.chat import load_tokenizer
    from engine.client import EngineClient
    from engine.records import STATUS_FAILED
    from judge_server.judge import JudgeService
    from judge_server.metrics import JudgeMetrics
    from judge_server.schemas import JudgeRequest
    from judge_server.settings import JudgeSettings

    settings = JudgeSettings(
        engine_url=router_url, tokenizer_path=str(model_dir), max_new_tokens=16, m=m, max_concurrent_engine_calls=64
    )
    sem = asyncio.Semaphore(concurrency)
    async with EngineClient(router_url) as client:
        service = JudgeService(settings, JudgeMetrics(), client=client, tokenizer=load_tokenizer(str(model_dir)))

        async def one(i: int) -> None:
            async with sem:
                out = await service.judge(JudgeRequest.model_validate(make_item(i)))
                assert out.prm is not None and out.prm.status != STATUS_FAILED, out.prm

        await asyncio.gather(*(one(-1 - i) for i in range(2)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(items)))
        return items / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--m", type=int, default=3)
    p.add_argument("--policy", default="cache_aware", help="sglang-router policy")
    args = p.parse_args()

    from devkit.tiny_model import build_tiny_model
    from tests.testkit.procs import start_dev_engine, start_router

    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")
        engines = [
            start_dev_engine(model, log_dir=work, name=f"engine{i}", extra_args=["--torch-threads", "1"])
            for i in range(2)
        ]
        for i, e in enumerate(engines):  # one core each (the engine's threads included)
            for tid in os.listdir(f"/proc/{e.pid}/task"):
                os.sched_setaffinity(int(tid), {cores[i % len(cores)]})
        rates = {}
        try:
            for n in (1, 2):
                router = start_router([e.url for e in engines[:n]], log_dir=work, name=f"router{n}", policy=args.policy)
                try:
                    rates[n] = asyncio.run(judged_per_s(router.url, model, args.items, args.concurrency, args.m))
                finally:
                    router.stop()
        finally:
            for e in engines:
                e.stop()
    print(
        f"# judge scale-out: PRM + hint, m={args.m}, {args.items} items, concurrency {args.concurrency}, "
        f"router policy {args.policy}, usable cores {len(cores)}"
    )
    print(f"1 engine : {rates[1]:.2f} judged items/s")
    print(f"2 engines: {rates[2]:.2f} judged items/s")
    print(f"ratio 2/1 = {rates[2] / rates[1]:.2f}x (ideal 2.00x)")


if __name__ == "__main__":
    main()
