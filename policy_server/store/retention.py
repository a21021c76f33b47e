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
- Oldest first, in transactions of about :data:`RETENTION_BATCH_ROWS` rows, samples and the turns they settle
  together, found through the partial index ``samples_unpurged`` (policy_server.store.migrations), so a sweep with
  nothing to purge reads no purged row;
  then the freed space is returned (``_return_space``: SQLite's incremental vacuum in bounded chunks,
  policy_server.store.sqlite; PostgreSQL's autovacuum reuses it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.records import SampleState as S
from policy_server.store.base import StoreDB, yield_store
from policy_server.store.connection import DB, DBRow

PURGED = '{"purged": true}'  # what a purged turn record holds: valid JSON, no text
RETENTION_BATCH_ROWS = 100  # rows purged per sweep transaction (bench.retention; docs/USERS_DATA.md)
MAX_BATCH_ROWS = 10_000  # a transaction's statements name its rows: PostgreSQL takes at most 65,535 parameters
# The oldest unpurged samples of each terminal status, in the terms of the ``samples_unpurged`` partial index: a
# literal status, as a planner uses a partial index only for a query whose WHERE implies the index's.
_UNPURGED = "SELECT sample_id, session_id FROM samples s WHERE status='{status}' AND purged_at IS NULL AND updated_at<?"
UNPURGED_CONSUMED = _UNPURGED.format(status=S.CONSUMED) + " ORDER BY updated_at LIMIT ?"
UNPURGED_REJECTED = (
    _UNPURGED.format(status=S.REJECTED)
    # settled sessions only (module docstring): each a probe of a session-keyed index on SQLite
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
        if not 1 <= batch_rows <= MAX_BATCH_ROWS:
            raise ValueError(f"batch_rows must be between 1 and {MAX_BATCH_ROWS}")
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
        """Purge the samples ``query`` finds and the turns of the sessions that settles, in transactions of about
        ``batch_rows`` rows of either kind; returns (samples, turns) purged.

        A transaction takes the candidates session by session, each with the turns purging it settles (in the same
        transaction: the last sample of a session is what makes its turns go, so they never wait for a later
        transaction that might not come), while the rows stay within ``batch_rows``: a sweep of sessions of eight
        turns settles about eleven of them a transaction, not a hundred. Only a session with more turns than
        ``batch_rows`` makes a longer one. The candidates left are found again by the next transaction. Six
        statements a transaction, whatever the sessions (on PostgreSQL each is a round trip)."""
        samples = turns = 0
        limit = batch_rows
        while True:
            t0 = time.perf_counter()
            with self._tx() as db:
                found = db.execute(query + self._skip_locked, (before, limit)).fetchall()
                by_session: dict[str, list[str]] = {}
                for sample_id, session_id in found:  # oldest first, grouped by session
                    by_session.setdefault(session_id, []).append(sample_id)
                settling = _settling_turns(db, found) if found else {}
                ids: list[str] = []
                settled: list[str] = []
                rows = 0
                for session_id, its in by_session.items():
                    cost = len(its) + settling.get(session_id, 0)
                    if ids and rows + cost > batch_rows:
                        break
                    ids, rows = ids + its, rows + cost
                    settled += [session_id] if session_id in settling else []
                if ids:
                    db.execute(
                        f"UPDATE samples SET data=NULL, purged_at=? WHERE sample_id IN ({_marks(ids)})",
                        (time.time(), *ids),
                    )
                    samples, turns = samples + len(ids), turns + _purge_settled_turns(db, settled)
            if len(found) < limit and len(ids) == len(found):
                return samples, turns
            # Next, about as many candidates as this transaction could take: sessions that settle many turns each
            # are not all read again only for one in nine of them to be taken.
            limit = batch_rows if len(ids) == len(found) else len(ids) + 1
            yield_store(t0)


def _marks(values: list[str]) -> str:
    return ", ".join("?" * len(values))


def _settling_turns(db: DB, found: Sequence[DBRow]) -> dict[str, int]:
    """Inside a transaction: the sessions of the candidate samples ``found`` (sample id, session id) that purging
    them settles (every unpurged sample of the session is among them and no turn of it awaits), with their turns
    still holding text."""
    ids = [r[0] for r in found]
    sessions = sorted({r[1] for r in found})
    rows = db.execute(
        f"SELECT t.session_id, COUNT(*) FROM turns t WHERE t.session_id IN ({_marks(sessions)}) AND t.record<>? "
        "AND NOT EXISTS (SELECT 1 FROM turns a WHERE a.session_id=t.session_id AND a.pairing='awaiting') "
        "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.session_id=t.session_id AND s.purged_at IS NULL "
        f"AND s.sample_id NOT IN ({_marks(ids)})) GROUP BY t.session_id",
        (*sessions, PURGED, *ids),
    ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def _purge_settled_turns(db: DB, sessions: list[str]) -> int:
    """Inside a transaction: empty the records of the turns of those ``sessions`` whose every sample is purged and
    none of whose turns awaits, and drop their feedback and stored answers; returns the turns purged.

    One statement decides and purges, so on PostgreSQL a turn or sample another transaction commits meanwhile is
    either seen by its check (and nothing of that session is purged) or not seen at all (and it is not touched)."""
    if not sessions:
        return 0
    rows = db.execute(
        f"UPDATE turns SET record=?, record_base=NULL, next_state=NULL WHERE session_id IN ({_marks(sessions)}) "
        "AND record<>? "
        "AND NOT EXISTS (SELECT 1 FROM turns a WHERE a.session_id=turns.session_id AND a.pairing='awaiting') "
        "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.session_id=turns.session_id AND s.purged_at IS NULL) "
        "RETURNING session_id",
        (PURGED, *sessions, PURGED),
    ).fetchall()
    done = sorted({r[0] for r in rows})
    if done:
        db.execute(f"DELETE FROM feedback WHERE session_id IN ({_marks(done)})", done)
        db.execute(f"DELETE FROM responses WHERE session_id IN ({_marks(done)})", done)
    return len(rows)


__all__ = ["PURGED", "RETENTION_BATCH_ROWS", "RetentionSweep", "StoreRetention"]
