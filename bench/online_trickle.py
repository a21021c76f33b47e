"""Live-traffic hand-off: samples arriving one at a time, leased by a trainer with ``--min-batch``.

    python bench/online_trickle.py [--samples 120] [--rate-hz 20] [--train-s 0.15] [--p-good 0.3] [--seed 0]

A producer makes one sample ``ready`` every 1/rate seconds through the real store write (``complete_judge``,
reward +1 with probability p-good, else -1), waking lease waiters through the in-process ready notifier. A
trainer loop leases with ``lease_when_ready`` (the lease route's wait) for each min-batch setting, "trains"
for ``--train-s`` (one checkpoint + weight push per step) and acks. The same recorded steps are then scored
under every baseline with ``trainer.baselines.rl_sample_advantages``: for each baseline and min-batch the
share of steps whose RL advantage is non-zero, and the samples per weight push, printed side by side (the
old default was min-batch 1 + batch_mean). No model is involved: this measures the hand-off and the
baselines, not training throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.records import Sample, SampleState, TurnRecord
from policy_server.store import Store
from policy_server.store.ready_notifier import LocalReadyNotifier, lease_when_ready
from trainer.baselines import BASELINES, RunningMean, rl_sample_advantages


async def run_live(
    n: int, rate_hz: float, train_s: float, min_batch: int, batch: int, p_good: float, seed: int
) -> tuple[list[list[float]], float]:
    """Steps (each the rewards it trained on) of one live run, and the lease wake-up latency p50 in ms."""
    with tempfile.TemporaryDirectory() as d:
        store = Store(d)
        notifier = LocalReadyNotifier()
        store.on_ready = notifier.notify
        rng = random.Random(seed)
        ready_at: dict[str, float] = {}
        done = asyncio.Event()

        def make_ready(i: int) -> None:
            store.record_turn(f"s{i}", TurnRecord(prompt_ids=[1], response_ids=[2]), session_done=True)
            [job] = [j for j in store.pending_jobs() if j["session_id"] == f"s{i}"]
            reward = 1.0 if rng.random() < p_good else -1.0
            ready_at[job["sample_id"]] = time.monotonic()  # just before the commit that makes it leasable
            store.complete_judge(
                job["sample_id"],
                status=SampleState.READY,
                reject_reason=None,
                included=True,
                data=Sample(sample_id=job["sample_id"], reward=reward),
            )

        async def produce() -> None:
            loop = asyncio.get_running_loop()
            for i in range(n):
                await loop.run_in_executor(None, make_ready, i)
                await asyncio.sleep(1.0 / rate_hz)
            done.set()

        steps: list[list[float]] = []
        wake_ms: list[float] = []
        producer = asyncio.create_task(produce())
        while True:
            asked = time.monotonic()
            got = await lease_when_ready(store, notifier, max_n=batch, min_n=min_batch, wait_s=2.0, lease_s=60)
            if got is None:
                if done.is_set():
                    break
                continue
            lease_id, samples = got
            newest = max(ready_at[s["sample_id"]] for s in samples)
            if newest > asked:  # the lease was waiting: the write of its newest sample woke it
                wake_ms.append((time.monotonic() - newest) * 1000)
            steps.append([float(s["reward"]) for s in samples])
            await asyncio.sleep(train_s)  # update + checkpoint + weight push
            store.ack(lease_id)
        await producer
        store.close()
    wake_ms.sort()
    return steps, wake_ms[len(wake_ms) // 2] if wake_ms else float("nan")


def nonzero_share(steps: list[list[float]], baseline: str) -> float:
    running = RunningMean(momentum=0.9, window=32 if baseline == "window" else 0)
    hits = 0
    for rewards in steps:
        r = torch.tensor(rewards)
        adv = rl_sample_advantages(r, torch.ones(len(rewards), dtype=torch.bool), baseline=baseline, running=running)
        hits += bool((adv != 0).any())
    return hits / max(len(steps), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=120, help="samples per run (one run per min-batch)")
    ap.add_argument("--rate-hz", type=float, default=20.0, help="samples made ready per second")
    ap.add_argument("--train-s", type=float, default=0.15, help="seconds one step 'trains' (checkpoint + push)")
    ap.add_argument("--p-good", type=float, default=0.3, help="probability of reward +1 (else -1)")
    ap.add_argument("--batch-size", type=int, default=8, help="lease max (the trainer's batch size)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the reward draws")
    args = ap.parse_args()
    print(
        f"{args.samples} samples at {args.rate_hz:g}/s, {args.train_s:g}s per step, P(+1) = {args.p_good:g}, "
        f"batch size {args.batch_size}"
    )
    results = {}
    for min_batch in (1, 4):
        steps, wake = asyncio.run(
            run_live(args.samples, args.rate_hz, args.train_s, min_batch, args.batch_size, args.p_good, args.seed)
        )
        results[min_batch] = steps
        print(
            f"min-batch {min_batch}: {len(steps)} steps (= weight pushes), "
            f"{sum(map(len, steps)) / max(len(steps), 1):.2f} samples per push, lease wake-up p50 {wake:.1f} ms"
        )
    print(f"{'baseline':<16}" + "".join(f"{'non-zero RL steps, min ' + str(m):>28}" for m in results))
    for b in BASELINES:
        print(f"{b:<16}" + "".join(f"{nonzero_share(results[m], b):>28.2f}" for m in results))
    old = nonzero_share(results[1], "batch_mean")
    new = nonzero_share(results[4], "running_mean")
    pushes = len(results[1]) / max(len(results[4]), 1)
    print(
        f"new default (min-batch 4, running_mean) vs old (min-batch 1, batch_mean): non-zero RL step share "
        f"{new:.2f} vs {old:.2f}; {pushes:.2f}x fewer weight pushes"
    )


if __name__ == "__main__":
    main()
