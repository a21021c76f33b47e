"""The weight-version ledger (a Store role class): every version the engines were given, and its state.

Role: the shared, durable record of which weights serve traffic, so every replica and every restart (even
after ``kill -9``) agrees on it. One row per version (:class:`~engine.records.WeightVersion`): its
checkpoint and parent, the samples it was trained on, when it was made, its state and why it changed.

State machine (each arrow one transaction, and the ledger's transactions serialise: below):

- :meth:`add_version`: a push is recorded ``candidate`` while its weights load. At most one version is
  pending (``candidate`` or ``canary``) at a time, enforced by a unique index, so of two concurrent pushes
  at any replicas one gets :class:`VersionConflict`. A push naming a ``parent`` the ledger knows must descend
  from the ``live`` version (a parent that was rolled back: code ``weights_rolled_back``). After a rollback
  the trainer's next push must restart from the restored weights: the restored version is marked
  ``parent_required`` and, until a push naming it as parent has loaded, a push naming no parent or one the
  ledger never recorded (the server cannot tell what those weights descend from) is refused
  (``parent_required``). Before any rollback such pushes are taken: a trainer without lineage, or one whose
  lineage predates this ledger, keeps working.
- :meth:`finish_push`: ``candidate -> canary`` (it must prove itself) or ``candidate -> live`` (the previous
  live one becomes ``retired``); a candidate naming the live version as parent clears its ``parent_required``.
  :meth:`drop_candidate` forgets a candidate whose weights did not load (the mark stays).
- :meth:`promote`: ``canary -> live``, the previous live one ``retired``.
- :meth:`roll_back`: the target (``live`` or ``retired``) becomes ``live``, marked ``parent_required``; every
  live, canary or candidate version made after it becomes ``rolled_back`` (a candidate still loading at another
  replica too: its push's :meth:`finish_push` is then refused, ``weights_rolled_back``). Samples of a
  rolled-back version are flagged when leased.

Concurrency: every change above decides on several rows (the live version, the parent, the pending one, the
versions newer than a rollback's target), so the changes serialise, at every replica: each is one transaction
that takes the store's ledger lock first (``_serialise(db, LEDGER_LOCK)``: a PostgreSQL transaction-scoped
advisory lock; SQLite's write transactions are serialised anyway), and its reads see every change committed
before it. Two changes that overlap end exactly as if one had committed before the other began: a push never
records a candidate from a parent that a concurrent rollback rolled back, nor one without a parent after it
marked ``parent_required``; a promotion, a push's finish and a rollback never leave two live versions or a
rollback refused half-way. One lock rather than row locks: the rows a change decides on are not all known
before it reads them (a rollback's newer versions, the live row a push's parent check reads), so row locks
would need a careful order at every call site, and ledger changes are a handful per hour.

Session pins and the rewards the canary test counts: policy_server.store.session_pins.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.records import SampleState, VersionState, WeightVersion
from policy_server.store.base import LEDGER_LOCK, StoreDB
from policy_server.store.connection import DB

_COLUMNS = (
    "version, checkpoint, parent, state, created_at, updated_at, sample_count, sample_id_min, sample_id_max, note, "
    "parent_required"
)
PENDING_STATES: tuple[VersionState, ...] = ("candidate", "canary")


class VersionConflict(ValueError):
    """A ledger change the current state refuses (HTTP 409); ``code`` names why."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class UnknownVersion(LookupError):
    """No ledger row has that version (HTTP 404)."""


def _version(row: Any) -> WeightVersion:
    fields = dict(row)
    fields["parent_required"] = bool(fields["parent_required"])  # stored 1 or NULL
    return WeightVersion(**fields)


class StoreVersions(StoreDB):
    """The ledger's reads and transitions (see the module docstring)."""

    @contextmanager
    def _ledger_tx(self) -> Iterator[DB]:
        """One ledger change: a write transaction that runs after every other ledger change that began before it
        has committed (the ledger lock is its first statement, so its reads see those changes)."""
        with self._tx() as db:
            self._serialise(db, LEDGER_LOCK)
            yield db

    def list_versions(self, limit: int = 100) -> list[WeightVersion]:
        """The newest ``limit`` versions, newest first."""
        with self._read() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM weight_versions ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [_version(r) for r in rows]

    def get_version(self, version: str) -> WeightVersion | None:
        with self._read() as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM weight_versions WHERE version=?", (version,)).fetchone()
        return None if row is None else _version(row)

    def version_in_state(self, state: VersionState) -> WeightVersion | None:
        """The newest version in ``state`` (there is at most one ``live`` and one pending version)."""
        with self._read() as db:
            row = db.execute(
                f"SELECT {_COLUMNS} FROM weight_versions WHERE state=? ORDER BY seq DESC LIMIT 1", (state,)
            ).fetchone()
        return None if row is None else _version(row)

    def rolled_back_versions(self) -> set[str]:
        """Every version that was rolled back (their samples are flagged when leased)."""
        with self._read() as db:
            rows = db.execute("SELECT version FROM weight_versions WHERE state='rolled_back'").fetchall()
        return {r[0] for r in rows}

    def ensure_live(self, version: str, checkpoint: str) -> WeightVersion:
        """At startup: the ledger's live version, recording the engines' current weights as live when the ledger
        has none yet (a new store, or one from before the ledger)."""
        now = time.time()
        with self._ledger_tx() as db:
            row = db.execute(
                f"SELECT {_COLUMNS} FROM weight_versions WHERE state='live' ORDER BY seq DESC LIMIT 1"
            ).fetchone()
            if row is not None:
                return _version(row)
            db.execute(
                "INSERT INTO weight_versions (version, seq, checkpoint, state, created_at, updated_at, note) "
                "SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, 'live', ?, ?, ? FROM weight_versions WHERE 1 = 1 ON CONFLICT DO NOTHING",
                (version, checkpoint, now, now, "the engines' weights when the ledger started"),
            )
            row = db.execute(f"SELECT {_COLUMNS} FROM weight_versions WHERE version=?", (version,)).fetchone()
        return _version(row)

    def add_version(self, push: WeightVersion, *, stale_after_s: float) -> WeightVersion:
        """Record a push as ``candidate`` (one transaction), or raise :class:`VersionConflict`: another version is
        pending (``update_in_progress`` / ``canary_in_progress``), the version exists (``version_exists``), its
        parent is not the live version (``weights_rolled_back`` when the parent was rolled back, else
        ``parent_not_live``), or the live version was restored by a rollback and the push names no parent the
        ledger knows (``parent_required``). A candidate older than ``stale_after_s`` (its pusher died mid-load) is
        dropped first."""
        now = time.time()
        with self._ledger_tx() as db:
            db.execute("DELETE FROM weight_versions WHERE state='candidate' AND created_at < ?", (now - stale_after_s,))
            same = db.execute("SELECT state FROM weight_versions WHERE version=?", (push.version,)).fetchone()
            if same is not None:
                raise VersionConflict(f"version {push.version} exists ({same['state']})", "version_exists")
            pending = db.execute("SELECT version, state FROM weight_versions WHERE pending=1").fetchone()
            if pending is not None:
                kind = "canary" if pending["state"] == "canary" else "update"
                raise VersionConflict(
                    f"version {pending['version']} is {pending['state']}: promote or roll it back first"
                    if kind == "canary"
                    else f"version {pending['version']} is being loaded; retry when it is done",
                    f"{kind}_in_progress",
                )
            self._check_parent(db, push.parent)
            inserted = db.execute(
                "INSERT INTO weight_versions (version, seq, checkpoint, parent, state, pending, created_at, "
                "updated_at, sample_count, sample_id_min, sample_id_max) "
                "SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, ?, 'candidate', 1, ?, ?, ?, ?, ? FROM weight_versions "
                "WHERE 1 = 1 ON CONFLICT DO NOTHING",  # WHERE: SQLite parses ON after a bare SELECT as a join
                (
                    push.version,
                    push.checkpoint,
                    push.parent,
                    now,
                    now,
                    push.sample_count,
                    push.sample_id_min,
                    push.sample_id_max,
                ),
            ).rowcount
            if not inserted:  # the version exists, or a concurrent push became pending first
                raise VersionConflict(
                    f"version {push.version} exists or another push is in progress", "update_in_progress"
                )
            row = db.execute(f"SELECT {_COLUMNS} FROM weight_versions WHERE version=?", (push.version,)).fetchone()
        return _version(row)

    def finish_push(self, version: str, state: VersionState, note: str) -> WeightVersion:
        """The candidate's weights loaded: it becomes ``canary`` or ``live`` (the previous live one ``retired``).

        In the same transaction, every consumed sample whose ack named no version is recorded as trained into this
        one (the audit's ``trained_weight_version``): a trainer acks a step's samples after its checkpoint and then
        pushes those weights, so the first version loaded after an ack holds that ack's samples.

        :class:`VersionConflict` ``weights_rolled_back`` when a rollback (at any replica) rolled the candidate back
        while its weights loaded, ``state_changed`` when it is no candidate."""
        if state not in ("canary", "live"):
            raise ValueError(f"a loaded candidate becomes canary or live, not {state}")
        with self._ledger_tx() as db:
            row = db.execute("SELECT state FROM weight_versions WHERE version=?", (version,)).fetchone()
            if row is not None and row["state"] == "rolled_back":
                live = db.execute("SELECT version, checkpoint FROM weight_versions WHERE state='live'").fetchone()
                raise VersionConflict(
                    f"version {version} was rolled back while its weights loaded; the live version is "
                    f"{live['version']}: reload its weights ({live['checkpoint']}) and push with parent_version "
                    f"{live['version']}",
                    "weights_rolled_back",
                )
            # A candidate descending from the live version: the restored weights have a loaded descendant.
            db.execute(
                "UPDATE weight_versions SET parent_required=NULL WHERE state='live' AND version IN "
                "(SELECT parent FROM weight_versions WHERE version=?)",
                (version,),
            )
            if state == "live":
                self._retire_live(db, note=f"replaced by {version}")
            done = self._set(db, version, state, note, expect=("candidate",))
            db.execute(
                "UPDATE samples SET trained_weight_version=? WHERE status=? AND trained_weight_version IS NULL",
                (version, SampleState.CONSUMED),
            )
            return done

    def drop_candidate(self, version: str) -> None:
        """A candidate whose weights did not load never served: forget it."""
        with self._ledger_tx() as db:
            db.execute("DELETE FROM weight_versions WHERE version=? AND state='candidate'", (version,))

    def promote(self, note: str) -> WeightVersion:
        """``canary -> live`` (the previous live one ``retired``); :class:`VersionConflict` (``no_canary``) without one."""
        with self._ledger_tx() as db:
            row = db.execute("SELECT version FROM weight_versions WHERE state='canary'").fetchone()
            if row is None:
                raise VersionConflict("no version is canary: nothing to promote", "no_canary")
            self._retire_live(db, note=f"replaced by {row['version']}")
            return self._set(db, row["version"], "live", note, expect=("canary",))

    def roll_back(self, to: str, note: str) -> list[WeightVersion]:
        """Make ``to`` live again, marked ``parent_required``, and every live, canary or candidate version made after
        it ``rolled_back`` (one transaction); returns the changed rows, ``to`` first. Restoring the live version
        with nothing newer changes nothing and marks nothing. :class:`UnknownVersion` for a version never recorded,
        :class:`VersionConflict` (``not_restorable``) for one that is not live or retired."""
        with self._ledger_tx() as db:
            target = db.execute("SELECT seq, state FROM weight_versions WHERE version=?", (to,)).fetchone()
            if target is None:
                raise UnknownVersion(f"no weight version {to!r} in the ledger")
            if target["state"] not in ("live", "retired"):
                raise VersionConflict(
                    f"version {to} is {target['state']}: only a live or retired version can be restored",
                    "not_restorable",
                )
            newer = db.execute(
                "SELECT version FROM weight_versions WHERE seq > ? AND state IN ('live', 'canary', 'candidate') "
                "ORDER BY seq",
                (target["seq"],),
            ).fetchall()
            if target["state"] == "live":  # already live (a canary is dropped): its own note stays
                row = db.execute(f"SELECT {_COLUMNS} FROM weight_versions WHERE version=?", (to,)).fetchone()
                changed = [_version(row)]
            else:
                changed = [self._set(db, to, "live", note, expect=("retired",))]
            for r in newer:
                changed.append(self._set(db, r["version"], "rolled_back", note, expect=("live", "canary", "candidate")))
            if len(changed) > 1 or target["state"] == "retired":
                db.execute("UPDATE weight_versions SET parent_required=1 WHERE version=?", (to,))
                changed[0] = changed[0].model_copy(update={"parent_required": True})
        return changed

    # ------------------------------------------------------------------ inside a transaction
    def _check_parent(self, db: Any, parent_version: str | None) -> None:
        """Raise :class:`VersionConflict` unless a push naming ``parent_version`` may load (see :meth:`add_version`)."""
        live = db.execute(
            "SELECT version, checkpoint, parent_required FROM weight_versions WHERE state='live'"
        ).fetchone()
        parent = None
        if parent_version is not None:
            parent = db.execute("SELECT state FROM weight_versions WHERE version=?", (parent_version,)).fetchone()
        if parent is not None and parent["state"] != "live":
            raise VersionConflict(
                f"parent version {parent_version} is {parent['state']}; the live version is "
                f"{live['version'] if live else None}: reload its weights before pushing",
                "weights_rolled_back" if parent["state"] == "rolled_back" else "parent_not_live",
            )
        if parent is None and live is not None and live["parent_required"]:
            named = (
                f"parent_version {parent_version}, which it never recorded" if parent_version else "no parent_version"
            )
            raise VersionConflict(
                f"the ledger's live version {live['version']} was restored by a rollback and this push names {named}: "
                f"reload its weights ({live['checkpoint']}) and push with parent_version {live['version']}",
                "parent_required",
            )

    def _retire_live(self, db: Any, note: str) -> None:
        db.execute(
            "UPDATE weight_versions SET state='retired', pending=NULL, parent_required=NULL, updated_at=?, note=? "
            "WHERE state='live'",
            (time.time(), note),
        )

    def _set(self, db: Any, version: str, state: VersionState, note: str, expect: tuple[str, ...]) -> WeightVersion:
        marks = ", ".join("?" for _ in expect)
        changed = db.execute(
            f"UPDATE weight_versions SET state=?, pending=?, updated_at=?, note=? WHERE version=? AND state IN ({marks})",
            (state, 1 if state in PENDING_STATES else None, time.time(), note, version, *expect),
        ).rowcount
        if not changed:
            raise VersionConflict(f"version {version} is not {' or '.join(expect)}", "state_changed")
        row = db.execute(f"SELECT {_COLUMNS} FROM weight_versions WHERE version=?", (version,)).fetchone()
        return _version(row)
