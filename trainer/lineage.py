"""Where the trainer's weights come from, across pushes, rollbacks and restarts (rank 0's ``out_dir/lineage.json``).

Role: the version the next push names as its parent (the last version the policy server took from this run, or
the version it restored by a rollback) and the samples trained since, so the server can refuse weights trained
from a rolled-back version (docs/SAFE_UPDATES.md). A reload decided after a rollback is written with the step it
was decided at: a crash before the next checkpoint (whose weights are still off the rejected path) resumes by
reloading again rather than pushing them. Written atomically (temp file + rename).
"""

from __future__ import annotations

import json
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
class RunLineage:
    """The published version, a pending reload, and the sample ids trained since the last push (not persisted:
    a restart resumes from a checkpoint whose samples were pushed or are trained again)."""

    published: str | None = None
    reload: Reload | None = None
    unpublished_ids: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, out_dir: Path) -> RunLineage:
        path = out_dir / LINEAGE_FILE
        if not path.exists():
            return cls()
        saved = json.loads(path.read_text())
        reload = saved.get("reload")
        return cls(saved.get("published"), Reload(**reload) if reload else None)

    def push_lineage(self) -> Lineage:
        ids = self.unpublished_ids
        return Lineage(self.published, len(ids), min(ids, default=None), max(ids, default=None))

    def reload_due(self, step: int) -> str | None:
        """The checkpoint to reload when resuming at ``step`` (a reload decided at or after that step), else None."""
        return self.reload.checkpoint if self.reload is not None and self.reload.step >= step else None

    def remember(self, out_dir: Path, version: str, reload: Reload | None = None) -> None:
        """The version the next push descends from, persisted with any reload it needs."""
        self.published, self.reload, self.unpublished_ids = version, reload, []
        saved = {"published": version, "reload": asdict(reload) if reload else None}
        tmp = out_dir / (LINEAGE_FILE + ".tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(out_dir / LINEAGE_FILE)
