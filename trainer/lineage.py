"""Where the trainer's weights come from, across pushes, rollbacks and restarts (rank 0's ``out_dir/lineage.json``).

Role: the version the next push names as its parent (the last version the policy server took from this run, or
the version it restored by a rollback) and the samples trained since, so the server can refuse weights trained
from a rolled-back version (docs/SAFE_UPDATES.md). A reload decided after a rollback is written with the step it
was decided at: a crash before the next checkpoint (whose weights are still off the rejected path) resumes by
reloading again rather than pushing them. Written atomically (temp file + rename).

It also names the checkpoints the server can restore without an operator reaching back to a retired version, which
checkpoint pruning keeps (trainer/checkpoint.py): the published version's (live, or canary on trial) and, while the
published version is on trial, the live version's it descends from (what dropping the canary restores). A push the
server defers is never in its ledger, so its checkpoint is not among them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.lease_client import Lineage

LINEAGE_FILE = "lineage.json"


@dataclass(frozen=True)
class Reload:
    """After a rollback: the restored checkpoint, decided at ``step``."""

    step: int
    checkpoint: str


@dataclass
class SampleSpan:
    """The samples trained since the last push, as a push reports them (count and id range), in constant memory:
    a canary's trial can defer pushes for hours while every rank admits samples."""

    count: int = 0
    first: str | None = None  # the smallest sample id
    last: str | None = None  # the largest sample id

    def add(self, sample_ids: Iterable[str]) -> None:
        for sample_id in sample_ids:
            self.count += 1
            self.first = sample_id if self.first is None else min(self.first, sample_id)
            self.last = sample_id if self.last is None else max(self.last, sample_id)


@dataclass
class RunLineage:
    """The published version and its checkpoint, the checkpoint a dropped canary falls back to, a pending reload, and
    the samples trained since the last push (not persisted: a restart resumes from a checkpoint whose samples were
    pushed or are trained again)."""

    published: str | None = None
    published_checkpoint: str | None = None
    fallback_checkpoint: str | None = None  # the live version's, while the published one is on trial; else None
    reload: Reload | None = None
    unpublished: SampleSpan = field(default_factory=SampleSpan)

    @classmethod
    def load(cls, out_dir: Path) -> RunLineage:
        path = out_dir / LINEAGE_FILE
        if not path.exists():
            return cls()
        saved = json.loads(path.read_text())
        reload = saved.get("reload")
        return cls(
            saved.get("published"),
            saved.get("published_checkpoint"),
            saved.get("fallback_checkpoint"),
            Reload(**reload) if reload else None,
        )

    def push_lineage(self) -> Lineage:
        span = self.unpublished
        return Lineage(self.published, span.count, span.first, span.last)

    def restorable(self) -> list[str]:
        """The checkpoints the server can restore by dropping a canary or keeping the live version (kept on disk)."""
        return [c for c in (self.published_checkpoint, self.fallback_checkpoint) if c is not None]

    def reload_due(self, step: int) -> str | None:
        """The checkpoint to reload when resuming at ``step`` (a reload decided at or after that step), else None."""
        return self.reload.checkpoint if self.reload is not None and self.reload.step >= step else None

    def remember_push(self, out_dir: Path, version: str, checkpoint: str, *, on_trial: bool) -> None:
        """The server took ``checkpoint`` as ``version``: live, or a canary on trial (``on_trial``), whose fallback
        is the version published before it (the live one: the server takes a push only from the live version). A
        re-push of the published version (a resume's re-sync) keeps its fallback."""
        fallback = self.fallback_checkpoint if version == self.published else self.published_checkpoint
        self._remember(out_dir, version, checkpoint, fallback if on_trial else None, None)

    def remember_restored(self, out_dir: Path, version: str, checkpoint: str, step: int) -> None:
        """A rollback made ``version`` (``checkpoint``) live: the next push descends from it, after a reload at ``step``."""
        self._remember(out_dir, version, checkpoint, None, Reload(step, checkpoint))

    def _remember(
        self, out_dir: Path, version: str, checkpoint: str, fallback: str | None, reload: Reload | None
    ) -> None:
        self.published, self.published_checkpoint, self.fallback_checkpoint = version, checkpoint, fallback
        self.reload, self.unpublished = reload, SampleSpan()
        saved = {
            "published": version,
            "published_checkpoint": checkpoint,
            "fallback_checkpoint": fallback,
            "reload": asdict(reload) if reload else None,
        }
        tmp = out_dir / (LINEAGE_FILE + ".tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(out_dir / LINEAGE_FILE)
