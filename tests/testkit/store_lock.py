"""Another process holding a SQLite database's write lock: what an operator's ``sqlite3`` shell, a backup or a second
server on the same data folder does to a policy server's store.

``ExternalLock(db_path, hold_s)`` returns once the lock is taken (the child says so); the child commits and exits
after ``hold_s`` seconds, or ``stop`` kills it first. The child is a plain Python process of its own, never one of
the services, so it is started here rather than through tests.testkit.procs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LOCKER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=5)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
print("released", flush=True)
"""


class ExternalLock:
    """Another PROCESS holding the SQLite write lock of ``db_path`` for ``hold_s`` seconds."""

    def __init__(self, db_path: Path, hold_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(db_path), str(hold_s)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "locked"  # synchronise on the lock being taken

    def wait_released(self, timeout_s: float) -> None:
        assert self.proc.wait(timeout=timeout_s) == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
