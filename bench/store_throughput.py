"""Bench: store throughput of SQLite (one replica) vs PostgreSQL (one and two replicas), side by side.

Run:  python -m bench.store_throughput [--sessions 64] [--turns 8] [--threads 4] [--batch 16]

Each replica is its own process with its own store (SQLite: the data dir's file; PostgreSQL: a pool on a
throwaway cluster started here with devkit.pgcluster, durable defaults: fsync on). Two measurements:

- turns recorded per second: ``--threads`` threads per replica each drive their share of ``--sessions``
  sessions of ``--turns`` continuing turns; every turn after the first carries the pairing of the one it answers
  (``record_turn(resolve=...)``: one commit per turn, the policy server's hot path);
- samples leased+acked per second: the same number of ``ready`` samples, taken by ``--threads`` trainers per
  replica with ``lease(--batch)`` + ``ack`` until none is left (exactly-once is checked: each sample once).

Printed: the rates per configuration and their ratios to SQLite. With two replicas the sessions and trainers are
split between the two processes (one database).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path

from devkit.pgcluster import PgCluster, PgUnavailable
from engine.records import Sample, SampleState, TurnRecord
from policy_server.store import Resolution, open_store

RECORD = TurnRecord(
    messages=[{"role": "user", "content": "x" * 200}],
    prompt_ids=list(range(300)),
    response_ids=list(range(64)),
    rollout_logprobs=[-0.5] * 64,
    response={"content": "y" * 120},
    weight_version="v0",
    weight_versions=["v0"],
    sampling_params={},
).to_json()


def _record_worker(url: str, data_dir: str, sessions: list[str], turns: int, threads: int, start, out) -> None:
    store = open_store(url, data_dir)
    chunks = [sessions[i::threads] for i in range(threads)]

    def drive(mine: list[str]) -> None:
        for sid in mine:
            for k in range(turns):
                resolve = Resolution(k - 1, "paired", [{"role": "user", "content": "thanks"}]) if k else None
                store.record_turn(sid, TurnRecord.model_validate(RECORD), session_done=k == turns - 1, resolve=resolve)

    out.put(_timed([threading.Thread(target=drive, args=(c,)) for c in chunks], start))
    store.close()


def _lease_worker(url: str, data_dir: str, threads: int, batch: int, start, out) -> None:
    store = open_store(url, data_dir)
    got: list[str] = []

    def take() -> None:
        while (lease := store.lease(batch, lease_s=600)) is not None:
            got.extend(str(s.sample_id) for s in lease[1])
            store.ack(lease[0])

    out.put((_timed([threading.Thread(target=take) for _ in range(threads)], start), got))
    store.close()


def _timed(pool: list[threading.Thread], start) -> float:
    """Seconds from starting ``pool`` (once ``start`` is set, so every process begins together) to its end."""
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def _run(workers: list[mp.Process], start, out, n: int) -> list:
    for w in workers:
        w.start()
    time.sleep(0.5)  # every replica has opened its store before the clock starts
    start.set()
    results = [out.get(timeout=600) for _ in range(n)]
    for w in workers:
        w.join()
    return results


def measure(url: str, data_dir: str, replicas: int, args: argparse.Namespace) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    sessions = [f"s{i}" for i in range(args.sessions)]
    start, out = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(
            target=_record_worker, args=(url, data_dir, sessions[r::replicas], args.turns, args.threads, start, out)
        )
        for r in range(replicas)
    ]
    wall = max(_run(workers, start, out, replicas))
    turns_per_s = args.sessions * args.turns / wall
    store = open_store(url, data_dir)
    jobs = store.pending_jobs()
    for j in jobs:
        store.complete_judge(
            j.sample_id,
            status=SampleState.READY,
            reject_reason=None,
            included=True,
            data=Sample(sample_id=j.sample_id, reward=1.0),
        )
    store.close()
    start, out = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(target=_lease_worker, args=(url, data_dir, args.threads, args.batch, start, out))
        for _ in range(replicas)
    ]
    results = _run(workers, start, out, replicas)
    ids = [i for _, got in results for i in got]
    assert len(ids) == len(set(ids)) == len(jobs), "a sample was leased twice or lost"
    return turns_per_s, len(ids) / max(w for w, _ in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("sqlite, 1 replica", *measure("", str(Path(tmp) / "sqlite"), 1, args)))
        try:
            cluster = PgCluster.start()
        except PgUnavailable as exc:
            print(f"PostgreSQL skipped: {exc}")
            cluster = None
        if cluster is not None:
            try:
                for replicas in (1, 2):
                    url = cluster.create_database(f"bench{replicas}")
                    rows.append((f"postgresql, {replicas} replica(s)", *measure(url, "", replicas, args)))
            finally:
                cluster.stop()
    base_turns, base_lease = rows[0][1], rows[0][2]
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.threads} threads per replica, lease batch {args.batch}"
    )
    print(f"{'configuration':28} {'turns/s':>9} {'ratio':>6} {'leased+acked/s':>15} {'ratio':>6}")
    for name, turns, lease in rows:
        print(f"{name:28} {turns:9.0f} {turns / base_turns:6.2f} {lease:15.0f} {lease / base_lease:6.2f}")


if __name__ == "__main__":
    main()
