"""The retention sweeper: how long raw text is kept once it can no longer be trained on.

Role: every ``retention_sweep_interval_s`` it asks the store (policy_server.store.retention ``sweep_retention``)
to purge the text of terminal samples (consumed, or rejected) whose status last changed more than
``consumed_text_retention_s`` ago (the sample JSON, and a session's turn records once all its samples are
purged) and side turns (opt-outs included) older than ``side_turn_retention_s``. Either setting unset keeps that
kind. The store purges in batches (a concurrent turn's commit waits for one batch, not the sweep) and SQLite
returns the freed pages to the filesystem in chunks of bounded lock time (policy_server.store.sqlite
``VACUUM_CHUNK_PAGES``); the interval, the batch and the chunk were chosen by ``python -m bench.retention``
(docs/USERS_DATA.md). Counted in ``hindsight_policy_deleted_rows_total{cause="retention"}``,
``hindsight_policy_retention_sweeps_total`` and ``..._retention_reclaimed_bytes_total``; logged quietly (each
sweep at DEBUG, the totals at INFO at most once per :data:`LOG_EVERY_S`: :class:`PurgeLog`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from policy_server.metrics import Metrics
from policy_server.settings import PolicySettings
from policy_server.store import SampleStore
from policy_server.store.retention import RetentionSweep

logger = logging.getLogger(__name__)

# At most one INFO line this often: a sweep every 5 s that purges something would otherwise log 12 lines a minute.
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class PurgeTotals:
    """What the sweeps purged since the previous INFO line."""

    sweeps: int
    samples: int
    turns: int
    side_turns: int
    seconds: float  # since the previous INFO line (or the sweeper's start)


class PurgeLog:
    """The sweeps' totals, due for an INFO line at most once per ``every_s`` and only when something was purged."""

    def __init__(self, now: float, every_s: float = LOG_EVERY_S):
        self.every_s = every_s
        self._since = now
        self._sweeps = self._samples = self._turns = self._side = 0

    def add(self, out: RetentionSweep, now: float) -> PurgeTotals | None:
        """Count one sweep (``now``: a monotonic clock); the totals to log when a line is due, else None."""
        self._sweeps += 1
        self._samples += out.samples
        self._turns += out.turns
        self._side += out.side_turns
        if not (self._samples or self._turns or self._side) or now - self._since < self.every_s:
            return None
        totals = PurgeTotals(self._sweeps, self._samples, self._turns, self._side, now - self._since)
        self._since = now
        self._sweeps = self._samples = self._turns = self._side = 0
        return totals


def sweep_once(
    store: SampleStore, settings: PolicySettings, metrics: Metrics, now: float | None = None
) -> RetentionSweep:
    """One sweep (blocking: a worker thread's), counted in the metrics."""
    now = time.time() if now is None else now
    text_s, side_s = settings.consumed_text_retention_s, settings.side_turn_retention_s
    before = store.file_bytes()
    out = store.sweep_retention(
        text_before=now - text_s if text_s is not None else None,
        side_before=now - side_s if side_s is not None else None,
    )
    after = store.file_bytes()
    metrics.retention_sweeps.inc()
    metrics.deleted_rows.labels(table="samples", cause="retention").inc(out.samples)
    metrics.deleted_rows.labels(table="turns", cause="retention").inc(out.turns)
    metrics.deleted_rows.labels(table="side_turns", cause="retention").inc(out.side_turns)
    if before is not None and after is not None and after < before:
        metrics.retention_reclaimed_bytes.inc(before - after)
    return out


async def run_retention(store: SampleStore, settings: PolicySettings, metrics: Metrics) -> None:
    """Sweep forever (nothing to do when neither retention setting is set); a store error is retried next tick."""
    if settings.consumed_text_retention_s is None and settings.side_turn_retention_s is None:
        return
    log = PurgeLog(time.monotonic())
    while True:
        await asyncio.sleep(settings.retention_sweep_interval_s)
        try:
            out = await asyncio.to_thread(sweep_once, store, settings, metrics)
        except Exception:
            logger.exception("retention sweep failed")
            continue
        logger.debug("retention sweep purged %s", out)
        if (totals := log.add(out, time.monotonic())) is not None:
            logger.info(
                "retention purged %d samples, %d turns, %d side turns in %d sweeps over %.0f s",
                totals.samples,
                totals.turns,
                totals.side_turns,
                totals.sweeps,
                totals.seconds,
            )
