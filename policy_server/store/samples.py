"""Judge and session-scope scoring outcomes: the middle of the sample state machine (a Store role class).

Role: the work queue of the judge dispatcher (policy_server.rewards.dispatch) and of session-scope PRM scoring
(policy_server.rewards.scoring). A resolved turn's sample starts ``pending_judge`` (policy_server.store.sessions); here:

- :meth:`StoreSamples.pending_jobs` lists the queue, :meth:`note_attempt` records a failed try
  (attempts+1, last_error) and the sample stays ``pending_judge`` for a retry;
- :meth:`complete_judge` moves ``pending_judge`` -> ``ready`` | ``rejected`` | ``pending_score`` with
  its Sample JSON, atomically with the session's at-least-one flag; a sample no longer
  ``pending_judge`` is left alone (a judge outcome is decided once);
- session scope: :meth:`scorable_sessions` finds done sessions with held samples and nothing
  undecided, :meth:`session_trajectory` reads the whole session, :meth:`note_score_attempt` records a
  failed try, and :meth:`complete_score` moves every held sample ``pending_score`` -> ``ready`` |
  ``rejected`` in ONE transaction.

A sample whose reward, teacher log-probs or token rewards are not usable numbers (engine.sample_values) is
stored ``rejected`` with ``invalid_values: <why>`` instead of ``ready``/``pending_score``. Every write that
made a sample ``ready`` tells ``on_ready`` after its commit (lease waiters wake up).

Every write is one transaction (policy_server.store.base); ``pending_score`` samples are never leasable (policy_server.store.leases).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.records import JUDGE_OUTCOME_STATUSES, SCORE_OUTCOME_STATUSES, RejectReason, Sample, SampleJSON
from engine.records import SampleState as S
from engine.sample_values import value_problem
from policy_server.store.base import StoreDB, dump_json
from policy_server.store.records import JudgeJob, ScoredSample, TrajectoryTurn
from policy_server.store.rows import judge_job, sample_row, sample_turn, turn_of


class StoreSamples(StoreDB):
    """Judge queue and outcomes, and session-scope scoring holds (see the module docstring)."""

    # ------------------------------------------------------------------ judge work
    def pending_jobs(self, available_to: str | None = None, now: float | None = None) -> list[JudgeJob]:
        """Every pending_judge sample in (session, turn) order, with the turn it belongs to.

        ``available_to`` (a replica id) leaves out the sessions another replica holds a live claim on."""
        claim, args = _claim_filter(available_to, now)
        with self._read() as db:
            rows = db.execute(
                "SELECT s.sample_id, s.session_id, s.turn_index, s.attempts FROM samples s "
                "JOIN sessions x ON x.session_id=s.session_id "
                "WHERE s.status=?" + claim + " ORDER BY s.session_id, s.turn_index",
                (S.PENDING_JUDGE, *args),
            ).fetchall()
        return [judge_job(r) for r in rows]

    def claim_session(self, session_id: str, owner: str, claim_s: float, now: float | None = None) -> bool:
        """Take (or renew) ``owner``'s claim on the session's judge and scoring work until ``now + claim_s``.

        True when ``owner`` holds the claim now: it was free, already ``owner``'s, or expired (its replica died
        or stalled). One conditional update, so of several replicas exactly one wins."""
        now = time.time() if now is None else now
        with self._tx() as db:
            return bool(
                db.execute(
                    "UPDATE sessions SET claimed_by=?, claim_expires_at=? WHERE session_id=? "
                    "AND (claimed_by IS NULL OR claimed_by=? OR claim_expires_at<?)",
                    (owner, now + claim_s, session_id, owner, now),
                ).rowcount
            )

    def release_session(self, session_id: str, owner: str) -> None:
        """Give up ``owner``'s claim (its worker is done), so any replica may take the session's next work."""
        with self._tx() as db:
            db.execute(
                "UPDATE sessions SET claimed_by=NULL, claim_expires_at=NULL WHERE session_id=? AND claimed_by=?",
                (session_id, owner),
            )

    def note_attempt(self, sample_id: str, error: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE samples SET attempts=attempts+1, last_error=?, updated_at=? WHERE sample_id=?",
                (error[:500], time.time(), sample_id),
            )

    def complete_judge(
        self,
        sample_id: str,
        *,
        status: str,
        reject_reason: str | None,
        included: bool,
        data: Sample | None,
    ) -> bool:
        """Persist a judge outcome atomically with the sample's status and the session's at-least-one flag.

        ``data`` is the :class:`~engine.records.Sample`; None for a turn rejected before judging.

        ``pending_score`` (session-scope PRM) holds an accepted sample until its session is scored; it counts
        as included for the at-least-one rule, which follows the pipeline's decisions in judging order; a
        ``rejected`` outcome (``invalid_values`` included) never does.
        """
        if status not in JUDGE_OUTCOME_STATUSES:
            raise ValueError(f"judge outcome status must be ready, rejected or pending_score, not {status!r}")
        raw = None if data is None else data.to_json()
        status, reject_reason = _checked(status, reject_reason, raw)
        with self._tx() as db:
            cur = db.execute(
                "UPDATE samples SET status=?, reject_reason=?, data=?, updated_at=? WHERE sample_id=? AND status=?",
                (status, reject_reason, dump_json(raw), time.time(), sample_id, S.PENDING_JUDGE),
            )
            # A rejected outcome never counts for at-least-one, whatever the caller passed: the value check
            # above may have just turned an accepted sample into ``invalid_values``.
            if cur.rowcount and included and status != S.REJECTED:
                db.execute(
                    "UPDATE sessions SET has_included=1 WHERE session_id="
                    "(SELECT session_id FROM samples WHERE sample_id=?)",
                    (sample_id,),
                )
        self._ready_changed(cur.rowcount if status == S.READY else 0)
        return bool(cur.rowcount)

    # ------------------------------------------------------------------ session-scope scoring
    def scorable_sessions(
        self, session_id: str | None = None, available_to: str | None = None, now: float | None = None
    ) -> list[str]:
        """Sessions (all, or just ``session_id``) whose held (``pending_score``) samples can be scored now: the
        session is done, no turn of it awaits its next state and none is ``pending_judge`` (all decided).
        ``available_to``: as in :meth:`pending_jobs`."""
        only = "AND s.session_id=? " if session_id is not None else ""
        claim, claim_args = _claim_filter(available_to, now)
        with self._read() as db:
            rows = db.execute(
                "SELECT DISTINCT s.session_id FROM samples s JOIN sessions x ON x.session_id=s.session_id "
                "WHERE s.status=? AND x.done=1 "
                + only
                + (claim.strip() + " " if claim else "")
                + "AND NOT EXISTS (SELECT 1 FROM samples p WHERE p.session_id=s.session_id AND p.status=?) "
                "AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id=s.session_id AND t.pairing='awaiting') "
                "ORDER BY s.session_id",
                (S.PENDING_SCORE, *((session_id,) if session_id is not None else ()), *claim_args, S.PENDING_JUDGE),
            ).fetchall()
        return [r[0] for r in rows]

    def session_trajectory(self, session_id: str) -> list[TrajectoryTurn]:
        """Every recorded turn of the session in turn order, each with its sample row (the Sample JSON as stored,
        or None while the turn awaits its next state)."""
        with self._read() as db:
            turns = db.execute("SELECT * FROM turns WHERE session_id=? ORDER BY turn_index", (session_id,)).fetchall()
            samples = {
                r["turn_index"]: r
                for r in db.execute("SELECT * FROM samples WHERE session_id=?", (session_id,)).fetchall()
            }
            records = self.turn_records.session(db, turns)
        out = []
        for row, record in zip(turns, records, strict=True):
            turn = turn_of(row, record)
            sample = samples.get(row["turn_index"])
            out.append(TrajectoryTurn(turn, None if sample is None else sample_row(sample, sample_turn(turn))))
        return out

    def note_score_attempt(self, session_id: str, error: str) -> int:
        """A failed scoring try of the session: every held sample gets attempts+1 and the error."""
        with self._tx() as db:
            return int(
                db.execute(
                    "UPDATE samples SET attempts=attempts+1, last_error=?, updated_at=? WHERE session_id=? AND status=?",
                    (error[:500], time.time(), session_id, S.PENDING_SCORE),
                ).rowcount
            )

    def complete_score(self, outcomes: Sequence[ScoredSample]) -> int:
        """Decide held samples in ONE transaction: each with status ``ready`` or ``rejected`` and its
        :class:`~engine.records.Sample`; a sample no longer ``pending_score`` is left alone. Returns how many
        moved."""
        for outcome in outcomes:
            if outcome.status not in SCORE_OUTCOME_STATUSES:
                raise ValueError(f"score outcome status must be ready or rejected, not {outcome.status!r}")
        checked = []
        for outcome in outcomes:
            raw = outcome.sample.to_json()
            checked.append((outcome.sample_id, *_checked(outcome.status, outcome.reject_reason, raw), raw))
        now = time.time()
        moved: dict[str, int] = dict.fromkeys(SCORE_OUTCOME_STATUSES, 0)
        with self._tx() as db:
            for sample_id, status, reason, raw in checked:
                moved[status] += db.execute(
                    "UPDATE samples SET status=?, reject_reason=?, data=?, updated_at=? WHERE sample_id=? AND status=?",
                    (status, reason, dump_json(raw), now, sample_id, S.PENDING_SCORE),
                ).rowcount
        self._ready_changed(moved[S.READY])
        return sum(moved.values())


def _checked(status: str, reject_reason: str | None, data: SampleJSON | None) -> tuple[str, str | None]:
    """A sample about to become leasable (or held for scoring) whose reward, teacher log-probs or token rewards
    are unusable (engine.sample_values) is rejected with the reason instead: never leased, visible in stats."""
    if status == S.REJECTED or data is None:
        return status, reject_reason
    why = value_problem(data)
    return (S.REJECTED, RejectReason.with_detail(RejectReason.INVALID_VALUES, why)) if why else (status, reject_reason)


def _claim_filter(available_to: str | None, now: float | None) -> tuple[str, tuple[str | float, ...]]:
    """SQL (``AND ...`` on the sessions alias ``x``) leaving out sessions another replica holds a live claim on."""
    if available_to is None:
        return "", ()
    now = time.time() if now is None else now
    return (" AND (x.claimed_by IS NULL OR x.claimed_by=? OR x.claim_expires_at<?)", (available_to, now))
