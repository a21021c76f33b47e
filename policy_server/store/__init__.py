"""The durable store of the policy server: sessions, turns, training samples and leases, on SQLite or PostgreSQL.

Role: the single source of truth of the policy server. Everything the server accepts (a recorded main
turn, a judge outcome, a lease) is committed here before it is acknowledged, so a crash (even ``kill -9``)
loses nothing and a restart resumes from the same state. With PostgreSQL several replicas share it:
any replica may serve any request of any session (docs/SCALING.md).

Backends (``--store-url``, :func:`open_store`): ``sqlite:///DIR`` or none (:class:`Store`, a WAL file
under the data dir; one process) and ``postgresql://...`` (:class:`PostgresStore`, a psycopg pool; many
replicas). One interface (:class:`~policy_server.store.base.StoreDB`), one schema with versioned
migrations (policy_server.store.migrations).

Contract (docs/CONTRACTS.md):

- ``sessions``: one row per session id: next turn index, last activity, done flag, whether it already
  has an included sample (for the at-least-one rule), and the count of history mismatches.
- ``turns``: one row per recorded main turn (the token-exact record) with its pairing state
  ``awaiting`` (next state not known yet) -> ``paired`` | ``session_end`` | ``mismatch``.
- ``samples``: one row per turn whose pairing is resolved, with status
  ``pending_judge -> ready -> leased -> consumed``, or ``rejected`` with ``reject_reason``.
  ``data`` holds the Sample JSON of CONTRACTS.md once judged. With session-scope PRM scoring
  (policy_server.rewards.scoring) a turn the pipeline accepted waits as ``pending_judge -> pending_score`` (its
  Sample JSON stored, not leasable) until its session is over and every turn of it is decided; then
  ``complete_score`` makes all of the session's ``pending_score`` samples ``ready`` or ``rejected`` in ONE
  transaction. A session's judge and scoring work is claimed by one replica at a time (``sessions.claimed_by``
  until ``claim_expires_at``; policy_server.store.samples).
- ``leases``: ``active -> acked`` or ``active -> expired``. Exactly-once: an acked sample is consumed
  and never leased again; a leased sample whose lease expires returns to ``ready``; acking twice is a
  no-op; acking an expired lease is refused (its samples may already be leased to someone else).
- ``runtime``: admin changes every replica must see and that survive a restart (the reward mode, the
  weight-sync pause); ``schema_migrations``: the applied schema versions.

Layout: a store is assembled from one class per role over a backend:

- policy_server.store.sessions: sessions and turns (the pairing half of the state machine);
- policy_server.store.samples: judge work claims and outcomes, session-scope scoring;
- policy_server.store.leases: ``ready`` -> ``leased`` -> ``consumed`` (or back to ``ready`` on expiry);
- policy_server.store.reads: stats, backlog and the read-only admin views;
- policy_server.store.feedback: explicit feedback on turns and when it applies to their samples;
- policy_server.store.privacy: users' data: session deletion (leased samples revoked), audit;
- policy_server.store.retention: users' data: purging text that will never be trained on;
- policy_server.store.versions: the weight-version ledger (candidate, canary, live, rolled_back, retired);
- policy_server.store.session_pins: the version each session is pinned to, and the per-session rewards the canary
  test counts;
- policy_server.store.base / sqlite / postgres / migrations: the connection layer.
"""

from __future__ import annotations

from pathlib import Path

from policy_server.store.base import SAMPLE_STATUSES, StoreDB
from policy_server.store.feedback import FeedbackConflict, StoreFeedback
from policy_server.store.leases import LeaseError, StoreLeases
from policy_server.store.migrations import LATEST_VERSION, SchemaError
from policy_server.store.postgres import PostgresDB
from policy_server.store.privacy import StorePrivacy
from policy_server.store.reads import StoreReads
from policy_server.store.responses import StoreResponses
from policy_server.store.retention import StoreRetention
from policy_server.store.samples import StoreSamples
from policy_server.store.session_pins import StoreSessionPins
from policy_server.store.sessions import Resolution, StoreSessions
from policy_server.store.sqlite import SqliteDB
from policy_server.store.versions import StoreVersions, UnknownVersion, VersionConflict

__all__ = [
    "LATEST_VERSION",
    "FeedbackConflict",
    "SAMPLE_STATUSES",
    "LeaseError",
    "PostgresStore",
    "Resolution",
    "SampleStore",
    "SchemaError",
    "Store",
    "StoreDB",
    "UnknownVersion",
    "VersionConflict",
    "open_store",
    "sqlite_dir",
]


class SampleStore(
    StoreSessions,
    StoreSamples,
    StoreLeases,
    StoreReads,
    StoreResponses,
    StoreFeedback,
    StorePrivacy,
    StoreRetention,
    StoreVersions,
    StoreSessionPins,
):
    """The whole store interface (every role above) over either backend: the type the services hold."""


class Store(SampleStore, SqliteDB):
    """The SQLite store under ``data_dir/hindsight.sqlite3`` (created on first use).

    ``Store(data_dir, synchronous="normal", busy_timeout_s=5.0)``; see policy_server.store.sqlite.
    """


class PostgresStore(SampleStore, PostgresDB):
    """The PostgreSQL store shared by replicas: ``PostgresStore(url, busy_timeout_s=5.0, pool_size=8)``; see
    policy_server.store.postgres."""


def sqlite_dir(store_url: str | None, data_dir: str | Path) -> Path | None:
    """The directory of a SQLite store URL (``sqlite:///abs/dir``, ``sqlite://rel/dir``), ``data_dir`` when there
    is no URL, None for a PostgreSQL URL; ValueError for any other scheme."""
    if not store_url:
        return Path(data_dir)
    if store_url.startswith(("postgresql://", "postgres://")):
        return None
    if store_url.startswith("sqlite://"):
        rest = store_url[len("sqlite://") :]
        return Path(rest) if rest else Path(data_dir)
    raise ValueError(f"store URL must start with sqlite:// or postgresql://, not {store_url.split(':', 1)[0]!r}")


def open_store(
    store_url: str | None,
    data_dir: str | Path,
    *,
    synchronous: str = "normal",
    busy_timeout_s: float = 5.0,
    pool_size: int = 8,
) -> SampleStore:
    """The store a URL names (see :func:`sqlite_dir`), schema migrated to the latest version."""
    directory = sqlite_dir(store_url, data_dir)
    if directory is not None:
        return Store(directory, synchronous=synchronous, busy_timeout_s=busy_timeout_s)
    assert store_url is not None
    return PostgresStore(store_url, busy_timeout_s=busy_timeout_s, pool_size=pool_size)
