"""The retention sweeper: how long raw text is kept once it can no longer be trained on.

Role: every ``retention_sweep_interval_s`` it asks the store (policy_server.store.privacy ``sweep_retention``)
to purge the text of samples consumed more than ``consumed_text_retention_s`` ago (the sample JSON, and the
session's turn records once all its samples are consumed and purged) and side turns (opt-outs included)
older than ``side_turn_retention_s``. Either setting unset keeps that kind. The store purges in batches
(a concurrent turn's commit waits for one batch, not the sweep) and SQLite returns the freed space to the
filesystem once enough of the file is free (policy_server.store.sqlite ``VACUUM_FREE_FRACTION``); the
interval, the batch and that threshold were chosen by ``python -m bench.retention`` (docs/USERS_DATA.md).
Counted in ``hindsight_policy_deleted_rows_total{cause=
"retention"}``, ``hindsight_policy_retention_sweeps_total`` and ``..._retention_reclaimed_bytes_total``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from policy_server.metrics import Metrics
from policy_server.settings import PolicySettings
from policy_server.store import SampleStore
from policy_server.store.privacy import RetentionSweep

logger = logging.getLogger(__name__)


def sweep_once(
    store: SampleStore, settings: PolicySettings, metrics: Metrics, now: float | None = None
) -> RetentionSweep:
    """One sweep (blocking: a worker thread's), counted in the metrics."""
    now = time.time() if now is None else now
    consumed_s, side_s = settings.consumed_text_retention_s, settings.side_turn_retention_s
    before = store.file_bytes()
    out = store.sweep_retention(
        consumed_before=now - consumed_s if consumed_s is not None else None,
        side_before=now - side_s if side_s is not None else None,
    )
    after = store.file_bytes()
    metrics.retention_sweeps.inc()
    metrics.deleted_rows.labels(table="samples", cause="retention").inc(out.consumed_samples)
    metrics.deleted_rows.labels(table="turns", cause="retention").inc(out.turns)
    metrics.deleted_rows.labels(table="side_turns", cause="retention").inc(out.side_turns)
    if before is not None and after is not None and after < before:
        metrics.retention_reclaimed_bytes.inc(before - after)
    return out


async def run_retention(store: SampleStore, settings: PolicySettings, metrics: Metrics) -> None:
    """Sweep forever (nothing to do when neither retention setting is set); a store error is retried next tick."""
    if settings.consumed_text_retention_s is None and settings.side_turn_retention_s is None:
        return
    while True:
        await asyncio.sleep(settings.retention_sweep_interval_s)
        try:
            out = await asyncio.to_thread(sweep_once, store, settings, metrics)
            if out.consumed_samples or out.turns or out.side_turns:
                logger.info("retention purged %s", out)
        except Exception:
            logger.exception("retention sweep failed")
