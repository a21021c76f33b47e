"""Bench: what the retention sweep and SQLite's VACUUM cost, and what a concurrent turn waits meanwhile.

Run:  python -m bench.retention [--backlogs 1000,10000,100000] [--batches 25,50,100,200,500]
                                [--chunks 32,64,128,256,512,1024] [--seed 0]

A terminal sample here is what a live turn leaves once trained on: a turn record with ``--text-bytes`` of text
and a Sample JSON with the token ids of that text (about twice its size), eight turns to a session, the last one
rejected ``no_next_state`` (as rl mode rejects a session's last turn) and the others consumed. The backlog is
built by copying, row for row, one such sample made through the store's API (``record_turn``,
``complete_judge``, ``lease``, ``ack``), so its shape is the store's own. Every figure is measured on SQLite (the
data dir's file) and on PostgreSQL (a throwaway cluster started with devkit.pgcluster, fsync on) where the
server binaries are installed (``--no-pg``: SQLite only).

1. Sweep: ``sweep_retention`` purges a backlog of terminal samples in transactions of about ``batch`` rows
   (samples and turns together) while a writer thread commits a small turn (``record_turn``)
   every 10 ms, open loop (a write held up delays the ones due behind it, and each wait counts from when it was
   due). Printed: the sweep's wall seconds (its pauses included), the lock it held (the longest transaction,
   and µs per purged row over the transactions), and the writer's p99 and worst wait while sweeping against an
   idle window, with how many of its writes failed StoreBusy. Returning the space is left out here (2 and 4).
2. VACUUM (SQLite, the stores created without incremental auto-vacuum): a ``--vacuum-samples`` store with a
   fraction of its samples purged: VACUUM's seconds (the store is locked all along), MB returned, ms of lock per
   MB returned and MB copied per second.
3. Interval: over the purged history each case of 1 left, an empty sweep (nothing to purge) with the partial
   index ``samples_unpurged`` and with a plain (status, updated_at) index, and a sweep that purges one row (its
   fixed cost: the transactions, and on SQLite the WAL checkpoint), in wall ms; and the share of the time that
   fixed cost takes at a few intervals (a sweep at traffic meets turns/s x interval rows, each costing what 1
   says).
4. Incremental vacuum (SQLite, every store this release creates): a copy of the ``--vacuum-samples`` store with
   its oldest half purged for each ``--chunks`` size, ``--chunk-runs`` chunks of it returned as ``_return_space``
   runs them (the vacuum and its WAL checkpoint in one hold of the store, then a pause as long) while the writer
   of 1 commits: each chunk's hold (median and longest), µs per page, the writer's p99 and worst wait; last, all
   of the free pages returned in chunks of ``VACUUM_CHUNK_PAGES``, as a sweep does.

Takes about five minutes on 2 shared cores with both backends (a 100k backlog is 2.9 GB on SQLite). Progress goes to stderr, the tables to stdout.
The figures and the rule that chose the defaults: docs/USERS_DATA.md (Retention).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

import policy_server.store.sqlite as sqlite_store
from devkit.pgcluster import PgCluster, PgUnavailable
from engine.records import Sample, TurnRecord
from policy_server.errors import StoreBusy
from policy_server.store import SampleStore, open_store
from policy_server.store.retention import RETENTION_BATCH_ROWS

TURNS_PER_SESSION = 8
OLD = 1000.0  # updated_at of the backlog: long past any cut-off
WRITE_EVERY_S = 0.01  # the concurrent writer's pace: 100 turns a second, a busy server
WORDS = "the a of to and in is it you that for on with as was be this have are not but what can do".split()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _text(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        word = rng.choice(WORDS) if rng.random() < 0.8 else "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=8))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_bytes]


def make_template(store: SampleStore, rng: random.Random) -> None:
    """One consumed sample of session ``tpl`` made through the store's API (:func:`template` reads its rows)."""
    tokens = max(1, ARGS.text_bytes // 4)  # ~4 bytes of text per token
    record = TurnRecord(
        messages=[{"role": "user", "content": _text(rng, ARGS.text_bytes // 2)}],
        prompt_ids=[],
        response_ids=[],
        rollout_logprobs=[],
        response={"content": _text(rng, ARGS.text_bytes // 2)},
        weight_version="v0",
        weight_versions=["v0"],
        sampling_params={},
    )
    store.record_turn("tpl", record, session_done=True)
    [job] = [j for j in store.pending_jobs() if j.session_id == "tpl"]
    data = Sample(
        sample_id=job.sample_id,
        session_id="tpl",
        mode="rl",
        reward=1.0,
        prm={"votes": [1, 1]},
        prompt_ids=[rng.randrange(150000) for _ in range(tokens)],
        response_ids=[rng.randrange(150000) for _ in range(tokens // 4)],
        rollout_logprobs=[round(-rng.random(), 4) for _ in range(tokens // 4)],
    )
    store.complete_judge(job.sample_id, status="ready", reject_reason=None, included=True, data=data)
    lease = store.lease(1, 60.0)
    assert lease is not None
    store.ack(lease[0])


def template(store: SampleStore) -> dict[str, dict[str, object]]:
    """The rows of the sample :func:`make_template` made, by table."""
    with store._read() as db:
        return {
            t: dict(db.execute(f"SELECT * FROM {t} WHERE session_id='tpl'").fetchone())
            for t in ("sessions", "turns", "samples")
        }


def fill(store: SampleStore, n: int, tpl: dict[str, dict[str, object]], prefix: str, at: tuple[float, float]) -> None:
    """``n`` terminal samples copied from ``tpl`` by the database itself (a recursive CTE: the text never
    crosses the socket), ``TURNS_PER_SESSION`` to a session (its last one rejected), sample ``i`` last updated at
    ``at[0] + i * at[1]``."""
    sid = f"'{prefix}' || CAST(i / {TURNS_PER_SESSION} AS TEXT)"
    k = f"i % {TURNS_PER_SESSION}"
    when = "? + i * ?"
    exprs = {
        "sessions": {"session_id": sid, "next_turn_index": str(TURNS_PER_SESSION)},
        "turns": {"session_id": sid, "turn_index": k, "created_at": when},
        "samples": {
            "sample_id": f"{sid} || '-' || CAST({k} AS TEXT)",
            "session_id": sid,
            "turn_index": k,
            "created_at": when,
            "updated_at": when,
            "status": f"CASE WHEN {k} = {TURNS_PER_SESSION - 1} THEN 'rejected' ELSE 'consumed' END",
            "reject_reason": f"CASE WHEN {k} = {TURNS_PER_SESSION - 1} THEN 'no_next_state' END",
        },
    }
    chunk = 5000  # rows a statement (each under the store's statement timeout)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        with store._tx() as db:
            for table, row in tpl.items():
                cols, values, params = [], [], []
                for col, value in row.items():
                    cols.append(col)
                    if col in exprs[table]:
                        values.append(exprs[table][col])
                        params += list(at) if exprs[table][col] == when else []
                    elif value is None:
                        values.append("NULL")
                    else:
                        values.append("?")
                        params.append(value)
                only = f" WHERE {k} = 0" if table == "sessions" else ""
                db.execute(
                    f"WITH RECURSIVE n(i) AS (SELECT {start} UNION ALL SELECT i + 1 FROM n WHERE i + 1 < {end}) "
                    f"INSERT INTO {table} ({','.join(cols)}) SELECT {','.join(values)} FROM n{only}",
                    params,
                )


@dataclass
class Waits:
    """What the concurrent writer saw: each write's due time and seconds, and how many failed StoreBusy."""

    due: list[float]
    seconds: list[float]
    busy: int

    def within(self, start: float, end: float) -> list[float]:
        """The seconds of the writes due between ``start`` and ``end``."""
        return [s for d, s in zip(self.due, self.seconds, strict=True) if start <= d <= end]


def p99(seconds: list[float]) -> float:
    if len(seconds) < 2:
        return max(seconds, default=float("nan"))
    return statistics.quantiles(seconds, n=100, method="inclusive")[98]


@contextmanager
def writer(store: SampleStore, tag: str) -> Iterator[Waits]:
    """A thread committing a small turn every ``WRITE_EVERY_S`` while the body runs."""
    small = TurnRecord(
        messages=[{"role": "user", "content": "hi"}],
        prompt_ids=[1, 2],
        response_ids=[3],
        rollout_logprobs=[-0.1],
        response={"content": "x"},
        weight_version="v0",
        weight_versions=["v0"],
        sampling_params={},
    )
    waits = Waits([], [], 0)
    stop = threading.Event()

    def run() -> None:
        # Open loop: write k is due at t0 + k * WRITE_EVERY_S and its wait counts from then, so a write held up
        # by the sweep also delays (and charges) the ones due behind it, as turns arriving meanwhile would be.
        t0 = time.perf_counter()
        k = 0
        while not stop.is_set():
            due = t0 + k * WRITE_EVERY_S
            if (ahead := due - time.perf_counter()) > 0:
                time.sleep(ahead)
            try:
                store.record_turn(f"{tag}{k}", small, session_done=False)
            except StoreBusy:
                waits.busy += 1
            waits.seconds.append(time.perf_counter() - due)
            waits.due.append(due)
            k += 1

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield waits
    finally:
        stop.set()
        thread.join()


@contextmanager
def no_vacuum(store: SampleStore) -> Iterator[None]:
    """Sweeps that leave the free pages in the file (returning them is measured on its own)."""
    inner = store._return_space
    store._return_space = lambda *, vacuum: inner(vacuum=False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del store._return_space


@contextmanager
def held(store: SampleStore) -> Iterator[list[float]]:
    """The seconds each write transaction of this thread held the store (from BEGIN to COMMIT) while the body
    runs; the concurrent writer's are left out."""
    inner, me, holds = store._tx, threading.get_ident(), []

    @contextmanager
    def tx() -> Iterator[object]:
        with inner() as db:
            t0 = time.perf_counter()
            yield db
        if threading.get_ident() == me:
            holds.append(time.perf_counter() - t0)

    store._tx = tx  # type: ignore[method-assign]
    try:
        yield holds
    finally:
        del store._tx


class Backend:
    """Stores of one backend: a backlog built once (:meth:`built`), and a fresh copy of it for each case."""

    def __init__(self, name: str, tmp: Path, cluster: PgCluster | None = None):
        self.name, self.tmp, self.cluster = name, tmp, cluster

    def _open(self, name: str, create: bool) -> SampleStore:
        if self.cluster is None:
            return open_store(None, self.tmp / name)
        return open_store(self.cluster.create_database(name) if create else self.cluster.url(name), "")

    def built(self, backlog: int, at: tuple[float, float]) -> str:
        """A closed store of ``backlog`` terminal samples, sample ``i`` last updated at ``at[0] + i * at[1]``; its
        name."""
        name = f"{self.name}{backlog}"
        store = self._open(name, create=True)
        make_template(store, random.Random(ARGS.seed))
        t0 = time.perf_counter()
        fill(store, backlog, template(store), "s", at)
        if self.cluster is not None:
            with store._tx() as db:
                db.execute("ANALYZE")  # the statistics autovacuum keeps on a live database
        store._return_space(vacuum=False)
        store.close()
        log(f"  {self.name}: {backlog} terminal samples built in {time.perf_counter() - t0:.1f}s")
        return name

    def copy(self, built: str, name: str) -> SampleStore:
        if self.cluster is None:
            shutil.copytree(self.tmp / built, self.tmp / name)
        else:
            with psycopg.connect(self.cluster.url(), autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{built}" STRATEGY FILE_COPY')
        os.sync()  # the copy's dirty pages written now, not while the case measures
        return self._open(name, create=False)

    def drop(self, name: str) -> None:
        """Give the copy's disk back."""
        if self.cluster is None:
            shutil.rmtree(self.tmp / name)
        else:
            with psycopg.connect(self.cluster.url(), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{name}"')


def wall_ms(fn: Callable[[], object], runs: int = 5) -> float:
    """The median wall milliseconds of ``fn``."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass(frozen=True)
class SweepRow:
    backend: str
    backlog: int
    batch: int
    failed: str  # why the sweep failed ("": it did not)
    sweep_s: float
    max_hold_ms: float  # the longest transaction
    us_per_row: float  # over the transactions (the pauses left out)
    idle_p99_ms: float
    idle_max_ms: float
    p99_ms: float
    max_ms: float
    busy: int
    empty_ms: float  # an empty sweep over this case's purged history, with samples_unpurged
    empty_old_ms: float  # the same with a plain (status, updated_at) index
    one_row_ms: float  # a sweep that purges one row


NAN = float("nan")


def sweep_case(backend: Backend, built: str, backlog: int, batch: int) -> SweepRow:
    name = f"{built}x{batch}"
    store = backend.copy(built, name)
    try:
        with writer(store, "idle") as idle:
            time.sleep(ARGS.idle_s)
        idle_s = idle.seconds[len(idle.seconds) // 5 :]  # the writer's first strides left out
        failed = ""
        with no_vacuum(store), writer(store, "busy") as busy, held(store) as holds:
            time.sleep(0.2)  # the writer is in its stride before the sweep starts
            t0 = time.perf_counter()
            try:
                out = store.sweep_retention(text_before=OLD + backlog, side_before=None, batch_rows=batch)
                assert out.samples == backlog, out  # the template (updated now) is younger than the cut-off
            except StoreBusy as exc:
                failed = str(exc)
            t1 = time.perf_counter()
            time.sleep(0.05)
        during = busy.within(t0, t1)
        log(f"  batch {batch}: swept in {t1 - t0:.1f}s {failed}")
        empty = empty_old = one_row = NAN
        if not failed and batch == ARGS.batch:
            fill(store, 1, template(store), "x", (OLD, 0.0))
            with no_vacuum(store):
                t2 = time.perf_counter()
                store.sweep_retention(text_before=OLD + 1, side_before=None)
                one_row = (time.perf_counter() - t2) * 1e3

                def sweep() -> None:
                    store.sweep_retention(text_before=OLD + backlog, side_before=None)

                empty = wall_ms(sweep)
                with store._tx() as db:
                    db.execute("DROP INDEX samples_unpurged")
                    db.execute("CREATE INDEX samples_plain ON samples (status, updated_at)")
                empty_old = wall_ms(sweep)
        return SweepRow(
            backend.name,
            backlog,
            batch,
            failed,
            t1 - t0,
            max(holds, default=NAN) * 1e3,
            sum(holds) / backlog * 1e6,
            p99(idle_s) * 1e3,
            max(idle_s) * 1e3,
            p99(during) * 1e3,
            max(during, default=NAN) * 1e3,
            busy.busy,
            empty,
            empty_old,
            one_row,
        )
    finally:
        store.close()
        backend.drop(name)


@dataclass(frozen=True)
class VacuumRow:
    free: float  # measured free share of the file before VACUUM
    file_mb: float
    vacuum_s: float
    returned_mb: float
    writer_max_ms: float


def vacuum_case(backend: Backend, built: str, fraction: float) -> VacuumRow:
    """VACUUM of a copy of ``built`` (``--vacuum-samples`` samples updated at 0, 1, ...) with a fraction purged."""
    name = f"vac{fraction}"
    store = backend.copy(built, name)
    try:
        with no_vacuum(store):
            store.sweep_retention(text_before=round(fraction * ARGS.vacuum_samples), side_before=None)
        with store._read() as db:
            free = db.execute("PRAGMA freelist_count").fetchone()[0] / db.execute("PRAGMA page_count").fetchone()[0]
        before = store.file_bytes() or 0
        with writer(store, "w") as waits:
            time.sleep(0.2)
            t0 = time.perf_counter()
            with store._read() as db:  # what _return_space(vacuum=True) runs past its threshold
                db.execute("VACUUM")
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            t1 = time.perf_counter()
            time.sleep(0.05)
        after = store.file_bytes() or 0
        log(f"  {fraction:.0%} purged: VACUUM {t1 - t0:.1f}s")
        return VacuumRow(free, before / 2**20, t1 - t0, (before - after) / 2**20, max(waits.within(t0, t1)) * 1e3)
    finally:
        store.close()
        backend.drop(name)


@contextmanager
def held_lock(store: SampleStore) -> Iterator[list[float]]:
    """The seconds each hold of the SQLite store lock by this thread lasted while the body runs."""
    inner, me, holds, since = store._lock, threading.get_ident(), [], threading.local()  # type: ignore[attr-defined]

    class Timed:
        def acquire(self, timeout: float = -1) -> bool:
            return bool(inner.acquire(timeout))

        def release(self) -> None:
            inner.release()

        def __enter__(self) -> Timed:
            inner.__enter__()
            since.t = time.perf_counter()
            return self

        def __exit__(self, *exc: object) -> None:
            if threading.get_ident() == me:
                holds.append(time.perf_counter() - since.t)
            inner.__exit__(*exc)

    store._lock = Timed()  # type: ignore[attr-defined]
    try:
        yield holds
    finally:
        store._lock = inner  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ChunkRow:
    pages: int  # a chunk's pages (0: the rest returned as a sweep does)
    chunks: int
    hold_p50_ms: float
    hold_max_ms: float
    us_per_page: float
    writer_p99_ms: float
    writer_max_ms: float
    returned_mb: float
    seconds: float


def chunk_case(backend: Backend, built: str, pages: int) -> ChunkRow:
    """Incremental vacuum of a copy of ``built`` with its oldest half purged: ``--chunk-runs`` chunks of ``pages``
    (0: all of the free pages, as a sweep returns them)."""
    name = f"chunks{pages}"
    store = backend.copy(built, name)
    try:
        with no_vacuum(store):
            store.sweep_retention(text_before=ARGS.vacuum_samples / 2, side_before=None)
        with store._read() as db:
            page_bytes = db.execute("PRAGMA page_size").fetchone()[0]
            count0 = db.execute("PRAGMA page_count").fetchone()[0]
        with writer(store, "w") as waits, held_lock(store) as holds:
            time.sleep(0.2)
            t0 = time.perf_counter()
            if pages:
                for _ in range(ARGS.chunk_runs):
                    store._vacuum_chunk(pages)  # type: ignore[attr-defined]
            else:
                store._return_space(vacuum=True)
            t1 = time.perf_counter()
            time.sleep(0.05)
        with store._read() as db:
            returned = count0 - db.execute("PRAGMA page_count").fetchone()[0]
        during = waits.within(t0, t1)
        log(f"  chunks of {pages or 'the default'}: {returned} pages in {t1 - t0:.2f}s")
        return ChunkRow(
            pages,
            len(holds),  # one hold a chunk (and for all of them, the final WAL checkpoint's)
            statistics.median(holds) * 1e3,
            max(holds) * 1e3,
            sum(holds) / max(returned, 1) * 1e6,
            p99(during) * 1e3,
            max(during, default=NAN) * 1e3,
            returned * page_bytes / 2**20,
            t1 - t0,
        )
    finally:
        store.close()
        backend.drop(name)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backlogs", type=_ints, default=_ints("1000,10000,100000"))
    ap.add_argument("--batches", type=_ints, default=_ints("25,50,100,200,500"))
    ap.add_argument("--batch", type=int, default=RETENTION_BATCH_ROWS, help="the batch the backlogs are swept in")
    ap.add_argument("--batch-backlog", type=int, default=10000, help="the backlog the batch sizes are compared on")
    ap.add_argument("--text-bytes", type=int, default=8192)
    ap.add_argument("--vacuum-samples", type=int, default=10000)
    ap.add_argument("--fractions", default="0.05,0.10,0.25,0.50")
    ap.add_argument("--chunks", type=_ints, default=_ints("64,128,256,512,1024,2048"), help="incremental vacuum pages")
    ap.add_argument("--chunk-runs", type=int, default=30, help="chunks measured of each size")
    ap.add_argument("--idle-s", type=float, default=1.0, help="the writer's idle window")
    ap.add_argument("--no-pg", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="only the SQLite space measures (2 and 4)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


ARGS: argparse.Namespace


def main() -> None:
    global ARGS
    ARGS = parse()
    rows: list[SweepRow] = []
    vacuums: list[VacuumRow] = []
    chunks: list[ChunkRow] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        backends = [Backend("sqlite", tmp)]
        if not ARGS.no_pg:
            try:
                backends.append(Backend("postgresql", tmp, PgCluster.start()))
            except PgUnavailable as exc:
                log(f"PostgreSQL skipped: {exc}")
        try:
            for backend in backends if not ARGS.no_sweep else []:
                for backlog in sorted({ARGS.batch_backlog, *ARGS.backlogs}):
                    log(f"sweep: {backend.name}, {backlog} samples")
                    built = backend.built(backlog, (OLD, 1e-3))
                    batches = ARGS.batches if backlog == ARGS.batch_backlog else []
                    for batch in sorted({*batches, ARGS.batch}):
                        rows.append(sweep_case(backend, built, backlog, batch))
                    backend.drop(built)
        finally:
            for backend in backends:
                if backend.cluster is not None:
                    backend.cluster.stop()
        log(f"vacuum: sqlite, {ARGS.vacuum_samples} samples")
        built = backends[0].built(ARGS.vacuum_samples, (0.0, 1.0))
        for fraction in (float(f) for f in ARGS.fractions.split(",")):
            vacuums.append(vacuum_case(backends[0], built, fraction))
        log("incremental vacuum: sqlite")
        chunks = [chunk_case(backends[0], built, pages) for pages in [*ARGS.chunks, 0]]
    report(rows, vacuums, chunks)


def report(rows: list[SweepRow], vacuums: list[VacuumRow], chunks: list[ChunkRow]) -> None:
    out = sys.stdout.write
    out(f"\n1. Sweep of terminal samples ({ARGS.text_bytes} B of text each) under a turn committed every 10 ms\n")
    out(
        f"{'backend':<11}{'backlog':>8}{'batch':>6}{'sweep s':>8}{'hold max ms':>12}{'us/row':>7}"
        f"{'idle p99':>9}{'idle max':>9}{'p99 ms':>8}{'max ms':>8}{'p99/idle':>9}{'busy':>5}\n"
    )
    for r in sorted(rows, key=lambda r: (r.backend, r.backlog, r.batch)):
        sweep = f"{r.sweep_s:>8.2f}" if not r.failed else f"{'FAILED':>8}"
        out(
            f"{r.backend:<11}{r.backlog:>8}{r.batch:>6}{sweep}{r.max_hold_ms:>12.0f}{r.us_per_row:>7.0f}"
            f"{r.idle_p99_ms:>9.1f}{r.idle_max_ms:>9.1f}{r.p99_ms:>8.1f}{r.max_ms:>8.0f}"
            f"{r.p99_ms / r.idle_p99_ms:>9.1f}{r.busy:>5}\n"
        )
    for r in rows:
        if r.failed:
            out(f"FAILED {r.backend} {r.backlog} batch {r.batch}: {r.failed}\n")
    out(f"\n2. VACUUM (SQLite) of a {ARGS.vacuum_samples}-sample store with a fraction of it purged\n")
    out(
        f"{'free':>6}{'file MB':>9}{'vacuum s':>10}{'MB back':>9}{'ms/MB back':>12}{'MB/s copied':>13}{'writer max':>12}\n"
    )
    for v in vacuums:
        copied = v.file_mb - v.returned_mb
        out(
            f"{v.free:>6.0%}{v.file_mb:>9.0f}{v.vacuum_s:>10.2f}{v.returned_mb:>9.0f}"
            f"{v.vacuum_s * 1e3 / max(v.returned_mb, 1e-9):>12.0f}{copied / v.vacuum_s:>13.0f}{v.writer_max_ms:>12.0f}\n"
        )
    out("\n3. Interval: sweeps over the purged history (wall ms), and the one-row sweep's share of the time\n")
    out(f"{'backend':<11}{'history':>8}{'empty':>8}{'empty old':>10}{'ratio':>7}{'one row':>9}")
    intervals = (5, 10, 30, 60)
    out("".join(f"{f'@{i} s':>9}" for i in intervals) + "\n")
    for r in sorted(rows, key=lambda r: (r.backend, r.backlog)):
        if r.batch != ARGS.batch or r.failed:
            continue
        out(
            f"{r.backend:<11}{r.backlog:>8}{r.empty_ms:>8.2f}{r.empty_old_ms:>10.2f}{r.empty_old_ms / r.empty_ms:>7.1f}"
            f"{r.one_row_ms:>9.2f}" + "".join(f"{r.one_row_ms / 1e3 / i:>9.3%}" for i in intervals) + "\n"
        )

    out(f"\n4. Incremental vacuum (SQLite) of the {ARGS.vacuum_samples}-sample store with its oldest half purged\n")
    out(
        f"{'pages':>7}{'chunks':>7}{'hold p50':>9}{'hold max':>9}{'us/page':>8}{'writer p99':>11}{'writer max':>11}"
        f"{'MB back':>8}{'s':>7}\n"
    )
    for c in chunks:
        out(
            f"{c.pages or 'rest':>7}{c.chunks:>7}{c.hold_p50_ms:>9.1f}{c.hold_max_ms:>9.1f}{c.us_per_page:>8.0f}"
            f"{c.writer_p99_ms:>11.1f}{c.writer_max_ms:>11.1f}{c.returned_mb:>8.0f}{c.seconds:>7.2f}\n"
        )
    out(f"(rest: returned as a sweep does, in chunks of {sqlite_store.VACUUM_CHUNK_PAGES} pages)\n")


if __name__ == "__main__":
    main()
