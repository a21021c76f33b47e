"""The throwaway PostgreSQL cluster as tests start it: devkit.pgcluster's cluster with fsync off (no test crashes the
host, so the OS's durability is not what is tested), or the calling test skipped, with the reason, on a machine
without the server binaries.

The cluster runs under ``pg_ctl`` (a daemon of its own), so ``stop`` is what ends it; the session fixture that
starts it (tests/conftest.py ``pg_cluster``) stops it at the end of the run.
"""

from __future__ import annotations

import pytest

from devkit.pgcluster import PgCluster, PgUnavailable


def start_pg_cluster() -> PgCluster:
    """A started cluster on a free 127.0.0.1 port (``create_database`` gives each test its own database)."""
    try:
        return PgCluster.start(fsync=False)
    except PgUnavailable as exc:
        pytest.skip(f"PostgreSQL tests need the server binaries: {exc}")
