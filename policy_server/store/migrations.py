"""Versioned schema migrations of the store, one list for both backends, applied in order exactly once.

Role: the only place the store's schema is defined or changed. ``MIGRATIONS[i]`` brings the schema from
version ``i`` to ``i + 1``; :func:`apply_migrations` (run when a store opens, and by
``hindsight-policy migrate``) applies the missing ones, each in one transaction together with its row in
``schema_migrations``, so a crash mid-upgrade leaves the previous version intact. A database whose
version is newer than this release knows is refused (:class:`SchemaError`): never a silent schema drift.

Version 1 is the schema of the release before migrations existed (``CREATE TABLE IF NOT EXISTS``, so such
a data dir is adopted as version 1 with nothing rewritten). Column types use ``{real}`` (SQLite ``REAL``,
PostgreSQL ``DOUBLE PRECISION``: timestamps need 64-bit floats) so the statements are shared.
Several replicas starting at once serialise on the backend's schema lock (``_serialise(db, SCHEMA_LOCK)``).
"""

from __future__ import annotations

import time

from policy_server.store.base import SCHEMA_LOCK, StoreDB
from policy_server.store.connection import DB

MIGRATIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "initial schema",
        (
            """CREATE TABLE IF NOT EXISTS sessions (
            session_id TEXT PRIMARY KEY,
            next_turn_index INTEGER NOT NULL DEFAULT 0,
            last_activity {real} NOT NULL,
            done INTEGER NOT NULL DEFAULT 0,
            has_included INTEGER NOT NULL DEFAULT 0,
            mismatches INTEGER NOT NULL DEFAULT 0)""",
            """CREATE TABLE IF NOT EXISTS turns (
            session_id TEXT NOT NULL,
            turn_index INTEGER NOT NULL,
            created_at {real} NOT NULL,
            record TEXT NOT NULL,
            pairing TEXT NOT NULL,
            pairing_note TEXT,
            next_state TEXT,
            session_done INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (session_id, turn_index))""",
            "CREATE INDEX IF NOT EXISTS turns_awaiting ON turns (session_id, pairing)",
            """CREATE TABLE IF NOT EXISTS samples (
            sample_id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL,
            turn_index INTEGER NOT NULL,
            status TEXT NOT NULL,
            reject_reason TEXT,
            attempts INTEGER NOT NULL DEFAULT 0,
            last_error TEXT,
            lease_id TEXT,
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL,
            data TEXT,
            UNIQUE (session_id, turn_index))""",
            "CREATE INDEX IF NOT EXISTS samples_status ON samples (status, created_at)",
            "CREATE TABLE IF NOT EXISTS runtime (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
            """CREATE TABLE IF NOT EXISTS leases (
            lease_id TEXT PRIMARY KEY,
            created_at {real} NOT NULL,
            expires_at {real} NOT NULL,
            state TEXT NOT NULL,
            sample_ids TEXT NOT NULL)""",
        ),
    ),
    # A session's judge work is claimed by one replica at a time (its turns are judged in order); a claim
    # that is not renewed expires (its replica died) and another replica takes the work over.
    (
        "judge work claims",
        (
            "ALTER TABLE sessions ADD COLUMN claimed_by TEXT",
            "ALTER TABLE sessions ADD COLUMN claim_expires_at {real}",
            "CREATE INDEX IF NOT EXISTS leases_active ON leases (state, expires_at)",
        ),
    ),
    # Stored Responses-API answers (store: true): ``previous_response_id`` continues the conversation one
    # of them ends (policy_server.store.responses).
    (
        "stored responses",
        (
            """CREATE TABLE IF NOT EXISTS responses (
            response_id TEXT PRIMARY KEY,
            session_id TEXT,
            previous_id TEXT,
            created_at {real} NOT NULL,
            messages TEXT NOT NULL)""",
        ),
    ),
    # Explicit feedback (POST /v1/feedback) names its turn by the response id the client got, or by
    # (session, turn index); each feedback is kept with its state (pending / applied / late / recorded).
    (
        "explicit feedback",
        (
            "ALTER TABLE turns ADD COLUMN response_id TEXT",
            "CREATE INDEX IF NOT EXISTS turns_response_id ON turns (response_id)",
            """CREATE TABLE IF NOT EXISTS feedback (
            feedback_id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL,
            turn_index INTEGER NOT NULL,
            value {real} NOT NULL,
            text TEXT,
            idempotency_key TEXT UNIQUE,
            state TEXT NOT NULL,
            created_at {real} NOT NULL,
            applied_at {real})""",
            "CREATE INDEX IF NOT EXISTS feedback_turn ON feedback (session_id, turn_index, created_at)",
        ),
    ),
    # Which rule identified a turn's session (policy_server.serving.identity), and side turns recorded as
    # side (served, never trained) with the rule that made them side (policy_server.serving.side_rules).
    (
        "session identity and side turns",
        (
            "ALTER TABLE turns ADD COLUMN session_rule TEXT",
            "ALTER TABLE turns ADD COLUMN session_decision TEXT",
            """CREATE TABLE IF NOT EXISTS side_turns (
            side_id TEXT PRIMARY KEY,
            session_id TEXT,
            created_at {real} NOT NULL,
            rule TEXT NOT NULL,
            record TEXT NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS side_turns_created ON side_turns (created_at)",
        ),
    ),
    # A continuing turn stores only what it adds to an earlier turn of its session, ``record_base`` naming
    # that turn and how much of it is kept (policy_server.store.turn_records); NULL: the record is whole.
    (
        "turn records as continuations",
        ("ALTER TABLE turns ADD COLUMN record_base TEXT",),
    ),
    # The sign of the judge's PRM verdict on a feedback's turn, written when the feedback is settled (NULL: not
    # judged yet, no verdict, or settled before this version), and feedback by time: the judge/feedback
    # agreement over the latest feedback then reads one index (policy_server.store.feedback), no sample JSON.
    (
        "feedback judge sign",
        (
            "ALTER TABLE feedback ADD COLUMN judge_sign INTEGER",
            "CREATE INDEX IF NOT EXISTS feedback_created ON feedback (created_at, feedback_id)",
        ),
    ),
    # Users' data (docs/USERS_DATA.md): the secret kinds redacted out of a turn (its sample is rejected
    # ``secret``), the leased samples a session deletion revoked (their ack tells the trainer), the weight
    # version an ack consumed a sample into, and the session indexes deletion and retention read by.
    (
        "users data",
        (
            "ALTER TABLE turns ADD COLUMN redacted TEXT",
            "ALTER TABLE side_turns ADD COLUMN redacted TEXT",
            "ALTER TABLE samples ADD COLUMN trained_weight_version TEXT",
            """CREATE TABLE IF NOT EXISTS revoked_samples (
            sample_id TEXT PRIMARY KEY,
            lease_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            revoked_at {real} NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS revoked_samples_lease ON revoked_samples (lease_id)",
            "CREATE INDEX IF NOT EXISTS side_turns_session ON side_turns (session_id)",
            "CREATE INDEX IF NOT EXISTS responses_session ON responses (session_id)",
            "CREATE INDEX IF NOT EXISTS samples_consumed ON samples (status, updated_at)",
        ),
    ),
    # The weight-version ledger and the sessions' version pins (policy_server.store.versions). ``pending`` is 1
    # while a version is a candidate or a canary and NULL otherwise: its unique index lets one version at a time
    # be pending, so of two pushes (at any replicas) one is refused; ``seq`` orders the versions as made.
    (
        "weight version ledger",
        (
            """CREATE TABLE IF NOT EXISTS weight_versions (
            version TEXT PRIMARY KEY,
            seq INTEGER NOT NULL,
            checkpoint TEXT NOT NULL,
            parent TEXT,
            state TEXT NOT NULL,
            pending INTEGER,
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL,
            sample_count INTEGER,
            sample_id_min TEXT,
            sample_id_max TEXT,
            note TEXT)""",
            "CREATE UNIQUE INDEX IF NOT EXISTS weight_versions_one_pending ON weight_versions (pending)",
            "CREATE INDEX IF NOT EXISTS weight_versions_seq ON weight_versions (seq)",
            # With safe updates each session is pinned to the version that served its first turn.
            """CREATE TABLE IF NOT EXISTS session_pins (
            session_id TEXT PRIMARY KEY,
            version TEXT NOT NULL,
            pinned_at {real} NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS session_pins_version ON session_pins (version, pinned_at)",
            # A loaded version is what the consumed samples no ack named a version for were trained into: the
            # partial index holds only those, so stamping them reads no older row.
            "CREATE INDEX IF NOT EXISTS samples_untrained ON samples (status) WHERE trained_weight_version IS NULL",
        ),
    ),
    # A version a rollback made live again accepts only pushes that name it as parent (the trainer reloaded its
    # weights) until one has loaded: 1 while that holds, NULL otherwise (policy_server.store.versions).
    (
        "weight version restored by rollback",
        ("ALTER TABLE weight_versions ADD COLUMN parent_required INTEGER",),
    ),
    # The retention sweep reads the consumed samples whose text is still there, oldest first: the partial index
    # holds only those, so a sweep reads no purged row (with ``samples_consumed`` an empty sweep read the whole
    # purged history, in a write transaction).
    (
        "retention reads unpurged samples",
        (
            "DROP INDEX IF EXISTS samples_consumed",
            (
                "CREATE INDEX IF NOT EXISTS samples_unpurged ON samples (status, updated_at) "
                "WHERE status='consumed' AND data IS NOT NULL"
            ),
        ),
    ),
    # Retention purges rejected samples too, and a session's turns once every sample of it is terminal and purged:
    # ``purged_at`` marks a sample retention has processed (a rejected one may have had no JSON to purge, yet its
    # session's turns are purged only after it). Samples consumed and purged before this version are marked. The
    # sweep reads each terminal status's unpurged samples oldest first through this partial index; the OR form
    # (not IN) lets SQLite see that ``status='consumed'`` alone implies it.
    (
        "retention purges rejected samples",
        (
            "ALTER TABLE samples ADD COLUMN purged_at {real}",
            "UPDATE samples SET purged_at=updated_at WHERE status='consumed' AND data IS NULL",
            "DROP INDEX IF EXISTS samples_unpurged",
            (
                "CREATE INDEX IF NOT EXISTS samples_unpurged ON samples (status, updated_at) "
                "WHERE (status='consumed' OR status='rejected') AND purged_at IS NULL"
            ),
        ),
    ),
)

LATEST_VERSION = len(MIGRATIONS)


class SchemaError(RuntimeError):
    """The database's schema version is not one this release can use."""


def schema_version(db: DB) -> int:
    """The version recorded in ``schema_migrations`` (0 for a database that has none)."""
    row = db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
    return int(row[0] or 0)


def apply_migrations(store: StoreDB, *, real_type: str) -> list[int]:
    """Bring the store's schema to :data:`LATEST_VERSION`; returns the versions applied (empty when current).

    ``store`` provides ``_tx()`` (one write transaction), ``_read()``, ``_has_table(name)`` and
    ``_serialise(db, SCHEMA_LOCK)`` (serialises concurrent migrators inside that transaction)."""
    applied: list[int] = []
    if store._has_table("schema_migrations"):  # the common case, a current schema, costs one read and no write
        with store._read() as db:
            current = schema_version(db)
        if _is_current(current):
            return applied
    with store._tx() as db:
        store._serialise(db, SCHEMA_LOCK)
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
            f"name TEXT NOT NULL, applied_at {real_type} NOT NULL)"
        )
    while True:
        with store._tx() as db:
            store._serialise(db, SCHEMA_LOCK)
            current = schema_version(db)
            if _is_current(current):
                return applied
            name, statements = MIGRATIONS[current]
            for statement in statements:
                db.execute(statement.format(real=real_type))
            db.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                (current + 1, name, time.time()),
            )
            applied.append(current + 1)


def _is_current(version: int) -> bool:
    """True at :data:`LATEST_VERSION`; a newer schema (written by a later release) is refused, never downgraded."""
    if version > LATEST_VERSION:
        raise SchemaError(
            f"store schema version {version} is newer than this release's "
            f"{LATEST_VERSION}: upgrade hindsight before opening this store"
        )
    return version == LATEST_VERSION
