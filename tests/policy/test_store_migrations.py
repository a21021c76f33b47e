"""Schema migrations (policy_server.store.migrations): a data dir of the release before versioned migrations
opens with nothing lost; a migrated store is not migrated again; a schema newer than the code is refused.

The release data dir is rebuilt here with that release's exact DDL and rows as it wrote them (sessions,
turns in every pairing state, samples in every status, a runtime setting, leases)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from engine.records import ModeSnapshot, TurnRecord
from policy_server.store import LATEST_VERSION, SchemaError, Store, open_store

pytestmark = pytest.mark.unit

# The DDL of the last release without schema_migrations, exactly as that release created it.
RELEASE_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, next_turn_index INTEGER NOT NULL DEFAULT 0,
    last_activity REAL NOT NULL, done INTEGER NOT NULL DEFAULT 0, has_included INTEGER NOT NULL DEFAULT 0,
    mismatches INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS turns (session_id TEXT NOT NULL, turn_index INTEGER NOT NULL, created_at REAL NOT NULL,
    record TEXT NOT NULL, pairing TEXT NOT NULL, pairing_note TEXT, next_state TEXT,
    session_done INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (session_id, turn_index));
CREATE INDEX IF NOT EXISTS turns_awaiting ON turns (session_id, pairing);
CREATE TABLE IF NOT EXISTS samples (sample_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, turn_index INTEGER NOT NULL,
    status TEXT NOT NULL, reject_reason TEXT, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT, lease_id TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, data TEXT, UNIQUE (session_id, turn_index));
CREATE INDEX IF NOT EXISTS samples_status ON samples (status, created_at);
CREATE TABLE IF NOT EXISTS runtime (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (lease_id TEXT PRIMARY KEY, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    state TEXT NOT NULL, sample_ids TEXT NOT NULL);
"""


def _record(text: str) -> str:
    return json.dumps(
        {
            "messages": [{"role": "user", "content": text}],
            "prompt_ids": [1, 2],
            "response_ids": [3],
            "rollout_logprobs": [-0.5],
            "response": {"content": "x"},
            "weight_version": "v0",
        }
    )


def _release_data_dir(path) -> None:
    path.mkdir()
    db = sqlite3.connect(path / "hindsight.sqlite3")
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(RELEASE_SCHEMA)
    db.executemany(
        "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)", [("a", 3, 100.0, 1, 1, 1), ("b", 1, 200.0, 0, 0, 0)]
    )
    db.executemany(
        "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            ("a", 0, 10.0, _record("a0"), "paired", None, json.dumps([{"role": "user", "content": "ok"}]), 0),
            ("a", 1, 11.0, _record("a1"), "mismatch", "edited", None, 0),
            ("a", 2, 12.0, _record("a2"), "session_end", None, None, 1),
            ("b", 0, 20.0, _record("b0"), "awaiting", None, None, 0),
        ],
    )
    sample = {"sample_id": "s-ready", "reward": 1.0, "response_ids": [3], "loss_mask": [1]}
    db.executemany(
        "INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            ("s-ready", "a", 0, "ready", None, 0, None, None, 10.0, 10.5, json.dumps(sample)),
            ("s-rejected", "a", 1, "rejected", "history_mismatch", 0, None, None, 11.0, 11.0, None),
            ("s-pending", "a", 2, "pending_judge", None, 2, "judge down", None, 12.0, 12.0, None),
        ],
    )
    db.execute("INSERT INTO runtime VALUES ('mode', ?)", (json.dumps({"mode": "opd", "w_rl": 1.0, "w_opd": 2.0}),))
    db.execute("INSERT INTO leases VALUES ('old-lease', 1.0, 2.0, 'acked', '[]')")
    db.commit()
    db.close()


def test_release_data_dir_opens_after_the_upgrade_with_nothing_lost(tmp_path):
    data = tmp_path / "data"
    _release_data_dir(data)
    st = Store(data)
    stats = st.stats()
    assert stats.samples == {
        "pending_judge": 1,
        "pending_score": 0,
        "ready": 1,
        "leased": 0,
        "consumed": 0,
        "rejected": 1,
    }
    assert stats.turns == 4 and stats.turns_awaiting_next_state == 1 and stats.history_mismatches == 1
    assert st.get_turn("a", 0).next_state == [{"role": "user", "content": "ok"}]
    assert st.get_turn("b", 0).messages[0]["content"] == "b0"
    assert st.get_runtime("mode", ModeSnapshot) == ModeSnapshot(mode="opd", w_rl=1.0, w_opd=2.0)
    assert [j.sample_id for j in st.pending_jobs("replica-1")] == ["s-pending"]
    assert [r.attempts for r in st.list_samples() if r.sample_id == "s-pending"] == [2]
    lease_id, [sample] = st.lease(10, lease_s=60)
    assert sample.reward == 1.0 and st.ack(lease_id).acked == 1
    assert (
        st.record_turn("b", TurnRecord.model_validate(json.loads(_record("b1"))), session_done=False) == 1
    )  # the session goes on
    st.close()
    db = sqlite3.connect(data / "hindsight.sqlite3")
    versions = [r[0] for r in db.execute("SELECT version FROM schema_migrations ORDER BY version")]
    db.close()
    assert versions == list(range(1, LATEST_VERSION + 1))
    st = Store(data)  # reopening applies nothing and keeps everything
    assert st.stats().samples["consumed"] == 1 and st.stats().turns == 5
    st.close()


def test_a_newer_schema_is_refused(tmp_path):
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "hindsight.sqlite3")
    db.execute("INSERT INTO schema_migrations VALUES (?, 'from the future', 0)", (LATEST_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(SchemaError, match="newer than this release"):
        Store(tmp_path)


def test_replicas_starting_together_migrate_once(pg_url):
    stores, errors = [], []

    def open_one() -> None:
        try:
            stores.append(open_store(pg_url, ""))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and len(stores) == 4
        with stores[0]._read() as db:
            versions = [r[0] for r in db.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()]
        assert versions == list(range(1, LATEST_VERSION + 1))
    finally:
        for st in stores:
            st.close()


@pytest.mark.process
def test_migrate_command_upgrades_a_release_data_dir(tmp_path):
    import subprocess
    import sys

    data = tmp_path / "data"
    _release_data_dir(data)
    done = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "migrate", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    schema, converted = done.stdout.strip().splitlines()
    assert schema == f"store schema at version {LATEST_VERSION}"
    assert converted.startswith("converted ") and "to incremental auto-vacuum" in converted  # the release's file
    db = sqlite3.connect(data / "hindsight.sqlite3")
    assert db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] == LATEST_VERSION
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
    assert db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 3
    db.close()
    bad = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "migrate", "--store-url", "mysql://x/y"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "sqlite:// or postgresql://" in bad.stderr


def test_retention_marks_upgrade_the_samples_the_previous_sweep_purged(tmp_path, monkeypatch):
    """A store at the version before "retention purges rejected samples": its consumed samples whose JSON the
    previous sweep purged are marked purged, its rejected ones are not, so the next sweep processes those and then
    purges the turns of the sessions it left (the previous sweep kept them for the rejected sample)."""
    import policy_server.store.migrations as migrations
    from engine.records import Sample
    from policy_server.store import Resolution

    version = next(
        i for i, (name, _) in enumerate(migrations.MIGRATIONS) if name == "retention purges rejected samples"
    )
    monkeypatch.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:version])
    monkeypatch.setattr(migrations, "LATEST_VERSION", version)
    st = Store(tmp_path)
    record = TurnRecord.model_validate(json.loads(_record("kept by the previous sweep")))
    st.record_turn("s", record, session_done=False)
    st.record_turn("s", record, session_done=True, resolve=Resolution(0, "paired", [{"role": "user"}]))
    for job in st.pending_jobs():
        data = Sample.model_validate({"sample_id": job.sample_id, "session_id": "s", "reward": 1.0})
        status, reason = ("ready", None) if job.turn_index == 0 else ("rejected", "no_next_state")
        st.complete_judge(job.sample_id, status=status, reject_reason=reason, included=True, data=data)
    lease_id, _ = st.lease(10, 60.0)
    st.ack(lease_id)
    with st._tx() as db:  # what the previous sweep did: the consumed JSON purged, the turns kept
        db.execute("UPDATE samples SET data=NULL WHERE status='consumed'")
    st.close()
    monkeypatch.undo()
    st = Store(tmp_path)
    with st._read() as db:
        marked = dict(db.execute("SELECT status, purged_at IS NOT NULL FROM samples").fetchall())
    assert marked == {"consumed": 1, "rejected": 0}
    out = st.sweep_retention(text_before=time.time() + 1, side_before=None)
    assert (out.samples, out.turns) == (1, 2) and st.get_turn("s", 0).messages == []
    st.close()
