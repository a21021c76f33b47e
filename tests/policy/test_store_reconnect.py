"""A PostgreSQL restart costs the policy server no request: pooled connections the server cut are replaced.

When PostgreSQL restarts (or an operator terminates backends), every idle connection in the store's pool is
dead, and the next transaction on each one would fail with ``AdminShutdown`` (a 503 to a live agent, one per
pooled connection). The pool checks a connection as it hands it out, so a dead one is replaced first.
"""

from __future__ import annotations

import time

import psycopg

from policy_server.store import open_store


def _terminate_other_backends(url: str) -> int:
    """What a restart does to the store's connections (``terminating connection due to administrator command``),
    returning once the terminated backends are gone: the server has then said goodbye on every socket, as after a
    restart that is over (a transaction racing the termination itself is a 503, and no check can prevent that)."""
    with psycopg.connect(url, autocommit=True) as conn:
        pids = {
            r[0]
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        }
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)).fetchone()
            if left is not None and left[0] == 0:
                break
            time.sleep(0.01)
    return len(pids)


def test_transactions_after_backends_are_terminated_succeed(pg_url: str) -> None:
    store = open_store(pg_url, "", pool_size=4)
    try:
        for _ in range(4):  # connections made and returned idle to the pool
            store.stats()
        assert _terminate_other_backends(pg_url) >= 1
        for _ in range(8):  # every pooled connection is dead: each must be replaced, none may fail
            store.stats()
    finally:
        store.close()


def _backend_pids(url: str) -> set[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return {r[0] for r in rows}


def test_a_live_connection_is_reused(pg_url: str) -> None:
    """The check does not churn connections: with nothing terminated, the same backends serve every transaction."""
    store = open_store(pg_url, "", pool_size=4)
    try:
        store.stats()
        before = _backend_pids(pg_url)
        for _ in range(20):
            store.stats()
        assert _backend_pids(pg_url) == before
    finally:
        store.close()
