"""Users' data in the store: deleting a session and its audit trail (a Store role class).

Role: the store half of docs/USERS_DATA.md. Contract:

- :meth:`StorePrivacy.delete_session` removes, in ONE transaction on either backend (a crash, even ``kill -9``,
  leaves all of it or none of it), the session's turns (the continuation bases with them: a turn's
  ``record_base`` names a turn of its own session), side turns, samples (whatever their status: the text of a
  consumed one goes too), feedback, stored Responses answers and revocation marks. A sample that was
  ``leased`` is recorded in ``revoked_samples`` under its lease, so the lease's ack answers it as ``revoked``
  (policy_server.store.leases) instead of consuming it. The ``sessions`` row stays (its id and counters, no
  text), ended and unclaimed: its turn indexes keep counting, so a later turn of the same id can never be
  mistaken for a deleted one by a replica's record cache. The answer (:class:`SessionDeletion`) counts what was
  removed and lists the samples that were already consumed into weights, with the weight version each went
  into. Judge work in flight for the session finds its sample gone and writes nothing.
- :meth:`StorePrivacy.session_audit`: each turn of a session with its sample's status, reject reason and the
  judge's stored verdicts (votes, raw outputs, guard results, hint), mode, weights and the weight version it
  was trained into.
- Retention (purging text once it can no longer be trained on): policy_server.store.retention.
"""

from __future__ import annotations

import json
import secrets
import time

from engine import fastjson
from engine.records import HintVerdict, Mode, PrmVerdict, Sample
from engine.records import SampleState as S
from policy_server.store.base import StoreDB
from policy_server.store.connection import DB, DBRow
from policy_server.store.records import StoreRecord

DELETION_KEY = "deletion_token_key"  # runtime key of the deletion tokens' HMAC key


class ConsumedSample(StoreRecord):
    """A sample that was already trained on when its session was deleted."""

    sample_id: str
    turn_index: int
    weight_version: str | None  # the version its ack named (None: the ack named none)


class DeletedRows(StoreRecord):
    """Rows one session deletion removed, by kind."""

    turns: int = 0
    side_turns: int = 0
    samples: int = 0  # every sample row removed, consumed ones included
    feedback: int = 0
    responses: int = 0  # stored Responses answers


class SessionDeletion(StoreRecord):
    """What one session deletion removed, revoked (leased samples whose ack will say so) and found already in the
    weights; also the HTTP answer of ``DELETE /v1/sessions/{id}``."""

    session_id: str
    deleted: DeletedRows
    revoked: list[str]
    consumed: list[ConsumedSample]


class TurnAudit(StoreRecord):
    """One turn of a session's audit trail (the judge's verdicts as the sample stored them)."""

    turn_index: int
    created_at: float
    pairing: str
    redacted: list[str]  # secret kinds redacted out of the turn
    sample_id: str | None
    status: str | None
    reject_reason: str | None
    mode: Mode | None
    w_rl: float | None
    w_opd: float | None
    reward: float | None
    prm: PrmVerdict | dict[str, object] | None  # votes, raw outputs, guard results (None: not judged)
    hint: HintVerdict | dict[str, object] | None  # None: not judged, or no hint task
    feedback: dict[str, object] | None
    prompt_versions: dict[str, str] | None
    rollout_weight_version: str | None  # the policy weights that sampled the reply
    trained_weight_version: str | None  # the weights an ack consumed it into


class SessionAudit(StoreRecord):
    """A session's audit trail, oldest turn first; also the HTTP answer of ``GET /v1/sessions/{id}/audit``."""

    session_id: str
    turns: list[TurnAudit]


class StorePrivacy(StoreDB):
    """Session deletion and audit (see the module docstring)."""

    def delete_session(self, session_id: str, now: float | None = None) -> SessionDeletion | None:
        """Remove the session's data in one transaction (module docstring); None when the store held no data of
        it (none ever, or deleted already)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            # The session row first: its row lock (PostgreSQL) queues a turn of this session being recorded now.
            session = db.execute(
                "SELECT session_id FROM sessions WHERE session_id=?" + self._for_update, (session_id,)
            ).fetchone()
            samples = db.execute(
                "SELECT sample_id, turn_index, status, lease_id, trained_weight_version FROM samples "
                "WHERE session_id=? ORDER BY turn_index" + self._for_update,
                (session_id,),
            ).fetchall()
            revoked = [r for r in samples if r["status"] == S.LEASED and r["lease_id"]]
            db.executemany(
                "INSERT INTO revoked_samples (sample_id, lease_id, session_id, revoked_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(sample_id) DO NOTHING",
                [(r["sample_id"], r["lease_id"], session_id, now) for r in revoked],
            )
            counts = {
                table: db.execute(f"DELETE FROM {table} WHERE session_id=?", (session_id,)).rowcount
                for table in ("samples", "turns", "side_turns", "feedback", "responses")
            }
            if session is not None:
                db.execute(
                    "UPDATE sessions SET done=1, has_included=0, claimed_by=NULL, claim_expires_at=NULL "
                    "WHERE session_id=?",
                    (session_id,),
                )
        self.turn_records.cache.clear()  # whole records held in memory: none of this session may be reused
        self._return_space(vacuum=False)  # no copy of the deleted rows left in the write-ahead log
        if not any(counts.values()):
            return None
        return SessionDeletion(
            session_id=session_id,
            deleted=DeletedRows(**counts),
            revoked=[r["sample_id"] for r in revoked],
            consumed=[
                ConsumedSample(
                    sample_id=r["sample_id"],
                    turn_index=int(r["turn_index"]),
                    weight_version=r["trained_weight_version"],
                )
                for r in samples
                if r["status"] == S.CONSUMED
            ],
        )

    def deletion_key(self) -> bytes:
        """The key of the sessions' deletion tokens (policy_server.serving.deletion_tokens): created on first use,
        one for every replica (the first writer wins), kept across restarts."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO runtime (key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING",
                (DELETION_KEY, json.dumps(secrets.token_hex(32))),
            )
            row = db.execute("SELECT value FROM runtime WHERE key=?", (DELETION_KEY,)).fetchone()
        return bytes.fromhex(json.loads(row[0]))

    def session_audit(self, session_id: str) -> SessionAudit | None:
        """The audit trail of a session's turns, oldest first; None when the store has no turn of it."""
        with self._read() as db:
            rows = db.execute(
                "SELECT t.turn_index, t.created_at, t.pairing, t.redacted, t.record, s.sample_id, s.status, "
                "s.reject_reason, s.data, s.trained_weight_version FROM turns t LEFT JOIN samples s "
                "ON s.session_id=t.session_id AND s.turn_index=t.turn_index WHERE t.session_id=? "
                "ORDER BY t.turn_index",
                (session_id,),
            ).fetchall()
        if not rows:
            return None
        return SessionAudit(session_id=session_id, turns=[_turn_audit(r) for r in rows])


def _turn_audit(r: DBRow) -> TurnAudit:
    sample = Sample.model_validate_json(r["data"]) if r["data"] else None
    record = fastjson.loads(r["record"]) if r["record"] else {}
    return TurnAudit(
        turn_index=int(r["turn_index"]),
        created_at=float(r["created_at"]),
        pairing=r["pairing"],
        redacted=r["redacted"].split(",") if r["redacted"] else [],
        sample_id=r["sample_id"],
        status=r["status"],
        reject_reason=r["reject_reason"],
        mode=sample.mode if sample else None,
        w_rl=sample.w_rl if sample else None,
        w_opd=sample.w_opd if sample else None,
        reward=sample.reward if sample else None,
        prm=sample.prm if sample else None,
        hint=sample.hint if sample else None,
        feedback=sample.feedback if sample else None,
        prompt_versions=sample.prompt_versions if sample else None,
        rollout_weight_version=(sample.weight_version if sample else None) or record.get("weight_version"),
        trained_weight_version=r["trained_weight_version"],
    )


def revoked_of(db: DB, lease_id: str) -> list[str]:
    """Inside a transaction: the samples of ``lease_id`` that a session deletion revoked."""
    rows = db.execute("SELECT sample_id FROM revoked_samples WHERE lease_id=? ORDER BY sample_id", (lease_id,))
    return [r[0] for r in rows.fetchall()]


__all__ = [
    "ConsumedSample",
    "DeletedRows",
    "SessionAudit",
    "SessionDeletion",
    "StorePrivacy",
    "TurnAudit",
]
