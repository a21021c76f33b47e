"""A process killed in the middle of a session deletion: what ``kill -9`` of a policy server does to that transaction.

``DeletingChild(store_url, session_id)`` returns once the child is inside ``delete_session``'s transaction, right
after its ``DELETE FROM turns`` (the child says so), where it waits; ``kill9`` then kills it with SIGKILL. The child
is a plain Python process of its own on the real store code (policy_server.store.privacy), never one of the
services, so it is started here rather than through tests.testkit.procs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, time
from policy_server.store import open_store
store = open_store(sys.argv[1], sys.argv[2])
real_tx = store._tx
class Paused:
    def __init__(self, tx):
        self.tx = tx
    def __enter__(self):
        db = self.tx.__enter__()
        class Db:
            def __getattr__(self, name):
                return getattr(db, name)
            def execute(self, sql, *a):
                cur = db.execute(sql, *a)
                if sql.startswith("DELETE FROM turns"):
                    print("mid-deletion", flush=True)  # the turns are gone inside the open transaction
                    time.sleep(120)
                return cur
        return Db()
    def __exit__(self, *exc):
        return self.tx.__exit__(*exc)
store._tx = lambda: Paused(real_tx())
store.delete_session(sys.argv[3])
"""


class DeletingChild:
    """A child process paused inside the deletion transaction of ``session_id`` (see the module docstring)."""

    def __init__(self, store_url: str, session_id: str, data_dir: Path):
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, store_url, str(data_dir), session_id],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # synchronise on the transaction being half done
        if line != "mid-deletion":
            self.proc.kill()
            raise AssertionError(f"the deleting child did not reach the middle of its deletion (said {line!r})")

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
