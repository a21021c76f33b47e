"""Retention in the store: purging raw text that will never be trained on (a Store role class).

Role: the store half of the retention sweeper (policy_server.serving.retention; docs/USERS_DATA.md "Retention").
Contract of :meth:`StoreRetention.sweep_retention`:

- A sample is terminal once it is ``consumed`` (trained on) or ``rejected``. A consumed sample's JSON is purged
  once its ack is older than the cut-off. A rejected sample's JSON is purged once its rejection (its last status
  change) is older than the cut-off and its session is settled: no turn of it awaits its next state and no sample
  of it is being judged or held for session scoring (a session scorer reads the rejected turns' verdicts as
  context, policy_server.rewards.scoring). Explicit feedback can re-include a sample rejected for its reward
  signal alone (policy_server.store.feedback_rule ``REDECIDABLE``) only while its JSON is there: the cut-off is
  also that feedback's window, later feedback is ``recorded``. Whatever the reason, a rejected sample is never
  trained once purged.
- Each processed sample gets ``purged_at`` (a rejected one may have had no JSON: its turn still had text). Once
  every sample of a session is purged and no turn of it awaits, the session's turn records, next states, feedback
  and stored Responses answers go too (a continuing turn's record needs its base turn's: they go together, never
  one alone). A session with a sample still pending, ready or leased keeps its turns, and that sample its JSON.
- Side turns (``opt_out`` ones included) older than their own cut-off are deleted.
- Oldest first, in transactions of at most :data:`RETENTION_BATCH_ROWS` rows found through the partial index
  ``samples_unpurged`` (policy_server.store.migrations), so a sweep with nothing to purge reads no purged row;
  then the freed space is returned (``_return_space``: SQLite's incremental vacuum in bounded chunks,
  policy_server.store.sqlite; PostgreSQL's autovacuum reuses it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.records import SampleState as S
from policy_server.store.base import StoreDB, yield_store
from policy_server.store.connection import DB

PURGED = '{"purged": true}'  # what a purged turn record holds: valid JSON, no text
RETENTION_BATCH_ROWS = 100  # rows purged per sweep transaction (bench.retention; docs/USERS_DATA.md)
# The oldest unpurged samples of each terminal status, in the terms of the ``samples_unpurged`` partial index: a
# literal status, as a planner uses a partial index only for a query whose WHERE implies the index's.
_UNPURGED = "SELECT sample_id FROM samples s WHERE status='{status}' AND purged_at IS NULL AND updated_at<?"
UNPURGED_CONSUMED = _UNPURGED.format(status=S.CONSUMED) + " ORDER BY updated_at LIMIT ?"
UNPURGED_REJECTED = (
    _UNPURGED.format(status=S.REJECTED)
    # settled sessions only (module docstring): one probe of each of two session-keyed indexes
    + f" AND NOT EXISTS (SELECT 1 FROM samples o WHERE o.session_id=s.session_id AND o.status IN "
    f"('{S.PENDING_JUDGE}', '{S.PENDING_SCORE}')) "
    "AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id=s.session_id AND t.pairing='awaiting') "
    "ORDER BY updated_at LIMIT ?"
)


@dataclass(frozen=True)
class RetentionSweep:
    """What one retention sweep purged."""

    samples: int  # terminal samples purged (consumed or rejected)
    turns: int
    side_turns: int


class StoreRetention(StoreDB):
    """The retention sweep (see the module docstring)."""

    def sweep_retention(
        self,
        *,
        text_before: float | None,
        side_before: float | None,
        batch_rows: int = RETENTION_BATCH_ROWS,
    ) -> RetentionSweep:
        """Purge terminal samples' text (and settled sessions' turns) whose samples last changed before
        ``text_before`` and side turns created before ``side_before`` (None: that kind is kept), oldest first, in
        transactions of at most ``batch_rows`` rows; then return the space. Blocking: it sleeps between
        transactions (a worker thread's call).

        Why batches: SQLite has one writer and the store one lock, so every turn's commit waits for the sweep's
        transaction to end (past ``busy_timeout_s`` it fails as StoreBusy), and PostgreSQL cancels a statement
        after twice that. A batch bounds the wait, and after each one the sweeper yields (``yield_store``)."""
        if batch_rows < 1:
            raise ValueError("batch_rows must be >= 1")
        samples = turns = side = 0
        if text_before is not None:
            for query in (UNPURGED_CONSUMED, UNPURGED_REJECTED):
                n, t = self._purge_samples(query, text_before, batch_rows)
                samples, turns = samples + n, turns + t
        while side_before is not None:
            t0 = time.perf_counter()
            with self._tx() as db:
                n = db.execute(
                    "DELETE FROM side_turns WHERE side_id IN (SELECT side_id FROM side_turns WHERE created_at<? "
                    "ORDER BY created_at LIMIT ?" + self._skip_locked + ")",
                    (side_before, batch_rows),
                ).rowcount
            side += n
            if n < batch_rows:
                break
            yield_store(t0)
        if turns:
            self.turn_records.cache.clear()  # whole records held in memory: the purged ones must not come back
        if samples or turns or side:
            self._return_space(vacuum=True)
        return RetentionSweep(samples=samples, turns=turns, side_turns=side)

    def _purge_samples(self, query: str, before: float, batch_rows: int) -> tuple[int, int]:
        """Purge the samples ``query`` finds, batch by batch, and the turns of the sessions that settles; returns
        (samples, turns) purged."""
        samples = turns = 0
        while True:
            t0 = time.perf_counter()
            with self._tx() as db:
                rows = db.execute(
                    f"UPDATE samples SET data=NULL, purged_at=? WHERE sample_id IN ({query}{self._skip_locked}) "
                    "RETURNING session_id",
                    (time.time(), before, batch_rows),
                ).fetchall()
                samples += len(rows)
                for sid in sorted({r[0] for r in rows}):
                    turns += _purge_settled_turns(db, sid)
            if len(rows) < batch_rows:
                return samples, turns
            yield_store(t0)


def _purge_settled_turns(db: DB, session_id: str) -> int:
    """Inside a transaction: empty the records of a session's turns when every sample of it is purged and none of
    its turns awaits, and drop its feedback and stored answers; returns the turns purged.

    One statement, so on PostgreSQL a turn or sample another transaction commits meanwhile is either seen by its
    check (and nothing is purged) or not seen at all (and it is not touched)."""
    n = db.execute(
        "UPDATE turns SET record=?, record_base=NULL, next_state=NULL WHERE session_id=? AND record<>? "
        "AND NOT EXISTS (SELECT 1 FROM turns a WHERE a.session_id=? AND a.pairing='awaiting') "
        "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.session_id=? AND s.purged_at IS NULL)",
        (PURGED, session_id, PURGED, session_id, session_id),
    ).rowcount
    if n:
        db.execute("DELETE FROM feedback WHERE session_id=?", (session_id,))
        db.execute("DELETE FROM responses WHERE session_id=?", (session_id,))
    return int(n)


__all__ = ["PURGED", "RETENTION_BATCH_ROWS", "RetentionSweep", "StoreRetention"]
