"""Live-traffic hand-off: samples arriving one at a time, leased by a trainer with ``--min-batch``.

    python -m bench.online_trickle [--samples 120] [--rate-hz 20] [--train-s 0.15] [--p-good 0.3] [--seed 0]
    python -m bench.online_trickle --closed-loop [--candidates default,min1,...] [--sessions 32] [--turns 4]

``--closed-loop`` is the live closed loop that chose the trainer's defaults (docs/REWARD_MODES.md "Defaults,
measured"): for each candidate a fresh dev stack (tests/testkit/stack.py: dev engine on a copy of the seeded
tiny model, policy server in mode rl, rules judge) takes a scripted user's sessions one at a time while
``hindsight-train`` runs alongside with the candidate's flags, leasing, training and pushing weights that
the later sessions are served by. Per candidate it prints the target share on held-out prompts before and
after, the optimizer steps (each has a non-zero gradient) and skipped batches, the weight versions the trained
samples came from (how many the trainer published during the traffic), the largest sample staleness, the
largest PPO clip fraction and gradient norm, and the wall time. One candidate at a time: runs are bounded by
the session count.

Without ``--closed-loop``, the hand-off alone:

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
import tempfile
import time
from pathlib import Path

import torch

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
            [job] = [j for j in store.pending_jobs() if j.session_id == f"s{i}"]
            reward = 1.0 if rng.random() < p_good else -1.0
            ready_at[job.sample_id] = time.monotonic()  # just before the commit that makes it leasable
            store.complete_judge(
                job.sample_id,
                status=SampleState.READY,
                reject_reason=None,
                included=True,
                data=Sample(sample_id=job.sample_id, reward=reward),
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
            newest = max(ready_at[str(s.sample_id)] for s in samples)
            if newest > asked:  # the lease was waiting: the write of its newest sample woke it
                wake_ms.append((time.monotonic() - newest) * 1000)
            steps.append([float(s.reward) for s in samples])  # every produced sample has a reward
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


# Candidate trainer settings of the closed loop: name -> flags on top of the trainer's defaults. Every run uses
# --lr 2e-2 unless the candidate sets it (the tiny random model's scale; the lr rows show the sensitivity).
CANDIDATES: dict[str, list[str]] = {
    "min8-running": ["--min-batch", "8", "--baseline", "running_mean"],
    "min4-running": ["--min-batch", "4", "--baseline", "running_mean"],
    "min1-running": ["--min-batch", "1", "--baseline", "running_mean"],
    "min4-batch_mean": ["--min-batch", "4", "--baseline", "batch_mean"],
    "min1-batch_mean": ["--min-batch", "1", "--baseline", "batch_mean"],
    "min4-running-e2m2": ["--min-batch", "4", "--baseline", "running_mean", "--ppo-epochs", "2", "--minibatches", "2"],
    "min1-running-e2": ["--min-batch", "1", "--baseline", "running_mean", "--ppo-epochs", "2"],
    "min1-running-e2m2": ["--min-batch", "1", "--baseline", "running_mean", "--ppo-epochs", "2", "--minibatches", "2"],
    "min4-running-e2": ["--min-batch", "4", "--baseline", "running_mean", "--ppo-epochs", "2"],
    "min1-running-e2-stale1": [
        "--min-batch",
        "1",
        "--baseline",
        "running_mean",
        "--ppo-epochs",
        "2",
        "--max-staleness",
        "1",
    ],
    "min4-running-e2-stale1": [
        "--min-batch",
        "4",
        "--baseline",
        "running_mean",
        "--ppo-epochs",
        "2",
        "--max-staleness",
        "1",
    ],
    "min4-running-lr5e-3": ["--min-batch", "4", "--baseline", "running_mean", "--lr", "5e-3"],
    "min1-running-lr5e-3": ["--min-batch", "1", "--baseline", "running_mean", "--lr", "5e-3"],
    "min1-running-stale1": ["--min-batch", "1", "--baseline", "running_mean", "--max-staleness", "1"],
    "min4-running-stale1": ["--min-batch", "4", "--baseline", "running_mean", "--max-staleness", "1"],
}
CLOSED_LOOP_LR = "2e-2"


def closed_loop(names: list[str], sessions: int, turns: int, pause_s: float) -> None:
    """Run each candidate's closed loop on a fresh stack and print one table row per candidate."""
    from devkit.tiny_model import build_tiny_model
    from engine.chat import load_tokenizer
    from tests.testkit.stack import run_trickle, start_stack
    from tests.trainer.test_learning_e2e import MAX_TOKENS, PROMPTS, has_target, target_frequency

    probes = (sessions // 4, sessions // 2)
    print(f"closed loop: {sessions} sessions x {turns} turns, one at a time, {pause_s:g}s think time per turn")
    print(
        f"| candidate | flags | held-out target share (start -> after {probes[0]}, {probes[1]} sessions -> end) "
        "| steps (non-zero grad) | skipped | trained-sample versions "
        "(published during traffic) | max staleness (stale set aside) | max clip_frac | max grad_norm | wall s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_model(Path(d) / "tiny", seed=0)
        tokenizer = load_tokenizer(str(model_dir))
        for name in names:
            flags = CANDIDATES[name]
            args = ["--micro-batch-size", "8", "--lease-wait-s", "10", "--idle-timeout-s", "12", *flags]
            if "--lr" not in flags:
                args = ["--lr", CLOSED_LOOP_LR, *args]
            stack = start_stack(model_dir, Path(d) / name, engine_seed=1)
            try:
                started = time.monotonic()
                start = target_frequency(stack.engine.url, tokenizer)
                shares: dict[int, float] = {}

                def probe(n: int, url: str = stack.engine.url, shares: dict[int, float] = shares) -> None:
                    if n in probes:
                        shares[n] = target_frequency(url, tokenizer)

                run = run_trickle(
                    stack,
                    Path(d) / name / "train",
                    args,
                    sessions=sessions,
                    turns=turns,
                    is_good=has_target,
                    prompts=PROMPTS,
                    max_tokens=MAX_TOKENS,
                    pause_s=pause_s,
                    after_session=probe,
                )
                end = target_frequency(stack.engine.url, tokenizer)
                wall = time.monotonic() - started
            finally:
                stack.stop()
            if run.rc != 0:
                print(f"| {name} | trainer exited {run.rc} | {run.log_tail[-300:]!r} |")
                continue
            m = run.metrics
            clip = max((x["clip_frac"] for x in m), default=float("nan"))
            norm = max((x["grad_norm"] for x in m), default=float("nan"))
            stale = sum(x.get("n_stale", 0) for x in [*m, *run.skipped])
            print(
                f"| {name} | {' '.join(flags)} | "
                f"{start:.3f} -> {' -> '.join(f'{shares[n]:.3f}' for n in sorted(shares))} -> {end:.3f} | {len(m)} | {len(run.skipped)} | {len(run.sample_versions)} "
                f"({len(run.versions_made_during_traffic())}) | {run.max_staleness()} ({stale}) | {clip:.3f} | {norm:.3g} | "
                f"{wall:.0f} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--closed-loop", action="store_true", help="run the live closed loop per candidate")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help=f"closed-loop candidates: {list(CANDIDATES)}")
    ap.add_argument("--sessions", type=int, default=32, help="closed loop: user sessions, one at a time")
    ap.add_argument("--turns", type=int, default=4, help="closed loop: judged turns per session")
    ap.add_argument("--pause-s", type=float, default=0.2, help="closed loop: the user's think time per turn")
    ap.add_argument("--samples", type=int, default=120, help="samples per run (one run per min-batch)")
    ap.add_argument("--rate-hz", type=float, default=20.0, help="samples made ready per second")
    ap.add_argument("--train-s", type=float, default=0.15, help="seconds one step 'trains' (checkpoint + push)")
    ap.add_argument("--p-good", type=float, default=0.3, help="probability of reward +1 (else -1)")
    ap.add_argument("--batch-size", type=int, default=8, help="lease max (the trainer's batch size)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the reward draws")
    args = ap.parse_args()
    if args.closed_loop:
        closed_loop([c for c in args.candidates.split(",") if c], args.sessions, args.turns, args.pause_s)
        return
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
