"""Leases and acks: the consumer end of the sample state machine, exactly-once (a Store role class).

Role: how the trainer takes training samples (``POST /v1/samples/lease`` and ``/v1/samples/ack``,
policy_server.api.lease). Contract (docs/CONTRACTS.md):

- :meth:`StoreLeases.lease` first expires overdue leases, then, when at least ``min_n`` (default 1)
  samples are ``ready``, moves up to ``max_n`` of them (oldest first) to ``leased`` under a new lease
  ``active`` until ``now + lease_s``, in one transaction; None when fewer than ``min_n`` are ready. Two
  concurrent leases, at one replica or several, never share a sample (SQLite serialises the transactions;
  PostgreSQL claims the rows ``FOR UPDATE SKIP LOCKED``).
- :meth:`next_lease_expiry`: the earliest deadline of an ``active`` lease (a waiter must look again
  then: the expiry returns samples to ``ready``).
- :meth:`ack` moves the lease's samples ``leased`` -> ``consumed`` and the lease ``active`` -> ``acked``.
  Acking twice is a no-op (``already_acked``); an unknown lease or one that expired raises
  :class:`LeaseError` (an expired lease's samples may already be leased to someone else).
- :meth:`expire_leases` moves every overdue ``active`` lease to ``expired`` and its samples back to
  ``ready`` (lease_id cleared), so nothing leased is lost if a consumer dies.

Exactly-once: a consumed sample is never leased again; each write is one transaction (policy_server.store.base).

Values: every writer checks a sample's values before it becomes ``ready`` (policy_server.store.samples); the lease
reads each row into its :class:`~engine.records.Sample` (the one read of the stored JSON) and checks the values
again (engine.sample_values), so a ``ready`` row written without that check (an older release, a hand-edited
database), or off the Sample schema, is moved to ``rejected`` with ``invalid_values: <why>`` and never leased.
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import ValidationError

from engine import fastjson
from engine.records import RejectReason, Sample
from engine.records import SampleState as S
from engine.sample_values import value_problem
from engine.validation import clip, describe_validation_errors
from policy_server.store.base import StoreDB
from policy_server.store.privacy import revoked_of
from policy_server.store.records import AckResult


def _read_sample(data: str | None) -> Sample | str:
    """A stored Sample JSON as its record, or why it may not be leased: its values break the rule
    (engine.sample_values, checked first so the reason names the value) or it is off the Sample schema."""
    raw = fastjson.loads(data) if data else {}
    why = value_problem(raw)
    if why:
        return why
    try:
        return Sample.model_validate(raw)
    except ValidationError as exc:
        return f"off the Sample schema: {describe_validation_errors(exc.errors(), limit=1)}"


def _answer(lease_id: str, acked: int, already: bool, revoked: list[str]) -> AckResult:
    """The ack answer; ``revoked`` set (so on the wire) only when a session deletion revoked some of the lease's
    samples."""
    if revoked:
        return AckResult(lease_id=lease_id, acked=acked, already_acked=already, revoked=revoked)
    return AckResult(lease_id=lease_id, acked=acked, already_acked=already)


class LeaseError(Exception):
    """An ack that cannot be honoured; ``kind`` is ``unknown`` or ``expired``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class StoreLeases(StoreDB):
    """Lease, ack and lease expiry over ``ready`` samples (see the module docstring)."""

    def expire_leases(self, now: float | None = None) -> int:
        """Return the samples of every lease past its deadline to ``ready``; returns how many."""
        now = time.time() if now is None else now
        with self._tx() as db:
            rows = db.execute(
                "SELECT lease_id FROM leases WHERE state='active' AND expires_at<=? ORDER BY lease_id"
                + self._skip_locked,
                (now,),
            ).fetchall()
            n = 0
            for (lease_id,) in rows:
                n += db.execute(
                    "UPDATE samples SET status=?, lease_id=NULL, updated_at=? WHERE lease_id=? AND status=?",
                    (S.READY, now, lease_id, S.LEASED),
                ).rowcount
                db.execute("UPDATE leases SET state='expired' WHERE lease_id=? AND state='active'", (lease_id,))
        self._ready_changed(n)
        return n

    def next_lease_expiry(self) -> float | None:
        """Unix time at which the earliest ``active`` lease expires; None when there is none."""
        with self._read() as db:
            row = db.execute("SELECT MIN(expires_at) FROM leases WHERE state='active'").fetchone()
        return None if row[0] is None else float(row[0])

    def lease(
        self, max_n: int, lease_s: float, now: float | None = None, *, min_n: int = 1
    ) -> tuple[str, list[Sample]] | None:
        """Lease up to ``max_n`` ready samples (oldest first); None when fewer than ``min_n`` are ready."""
        now = time.time() if now is None else now
        self.expire_leases(now)
        with self._tx() as db:
            rows = db.execute(
                "SELECT sample_id, data FROM samples WHERE status=? ORDER BY created_at, sample_id LIMIT ?"
                + self._skip_locked,
                (S.READY, max_n),
            ).fetchall()
            # The store's JSON edge: each row is read into its Sample once; one that is off the schema or breaks the
            # value rule is never leased.
            samples: list[tuple[str, Sample]] = []
            poisoned: list[tuple[str, str]] = []
            for r in rows:
                read = _read_sample(r["data"])
                if isinstance(read, str):
                    poisoned.append((r["sample_id"], read))
                else:
                    samples.append((r["sample_id"], read))
            if poisoned:
                db.executemany(
                    "UPDATE samples SET status=?, reject_reason=?, updated_at=? WHERE sample_id=?",
                    [
                        (S.REJECTED, RejectReason.with_detail(RejectReason.INVALID_VALUES, why), now, sid)
                        for sid, why in poisoned
                    ],
                )
            if not samples or len(samples) < min_n:
                return None
            lease_id = uuid.uuid4().hex
            ids = [sid for sid, _ in samples]
            db.executemany(
                "UPDATE samples SET status=?, lease_id=?, updated_at=? WHERE sample_id=?",
                [(S.LEASED, lease_id, now, i) for i in ids],
            )
            db.execute(
                "INSERT INTO leases (lease_id, created_at, expires_at, state, sample_ids) VALUES (?, ?, ?, 'active', ?)",
                (lease_id, now, now + lease_s, json.dumps(ids)),
            )
        return lease_id, [data for _, data in samples]

    def ack(self, lease_id: str, now: float | None = None, *, weight_version: str | None = None) -> AckResult:
        """Consume a lease's samples. Idempotent for an acked lease; LeaseError if unknown or expired.
        ``weight_version``: the weights the trainer consumed them into (kept per sample for the audit); the
        answer's ``revoked`` lists the lease's samples a session deletion removed (never consumed)."""
        now = time.time() if now is None else now
        self.expire_leases(now)
        with self._tx() as db:
            row = db.execute(
                "SELECT state, sample_ids FROM leases WHERE lease_id=?" + self._for_update, (lease_id,)
            ).fetchone()
            if row is None:
                raise LeaseError("unknown", f"unknown lease_id {clip(lease_id)}")
            if row["state"] == "acked":
                return _answer(lease_id, 0, True, revoked_of(db, lease_id))
            if row["state"] == "expired":
                raise LeaseError("expired", f"lease {lease_id} expired; its samples were returned to ready")
            n = db.execute(
                "UPDATE samples SET status=?, updated_at=?, trained_weight_version=? WHERE lease_id=? AND status=?",
                (S.CONSUMED, now, weight_version, lease_id, S.LEASED),
            ).rowcount
            db.execute("UPDATE leases SET state='acked' WHERE lease_id=?", (lease_id,))
            revoked = revoked_of(db, lease_id)  # deleted with their session while leased: the trainer drops them
        return _answer(lease_id, n, False, revoked)
