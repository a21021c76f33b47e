"""How parallel workers (pytest-xdist, ``--dist loadfile``) take the suite's files.

Each file runs whole on one worker, so its module-scoped servers start once. The files come in collection
order, which tests/conftest.py arranges with the files holding ``slow`` tests first (xdist's default order,
most tests first, would start a one-test file such as the real-agent run last, and the run would end waiting
for it alone).

xdist hands a worker its next file before the current one's last test runs (that test must know what
follows it to tear down its module's fixtures), so the next file waits behind the current one. When the
worker still holds a file it has not started, that next file comes from the END of the queue, the quick
files collected last; otherwise from the front. So a slow file never waits behind another slow one, and
the slow files start as early as there are workers for them.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling


class SlowFilesFirst(LoadFileScheduling):
    """``--dist loadfile`` in collection order, with the next-file rule above."""

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        held = self.assigned_work[node]
        if self._pending_of(held) > 2:  # xdist's own threshold: well before its last test
            return
        holds_an_unstarted_file = any(not any(tests.values()) for tests in held.values())
        self._take(node, from_end=holds_an_unstarted_file)

    def _assign_work_unit(self, node: Any) -> None:
        self._take(node, from_end=False)

    def _take(self, node: Any, *, from_end: bool) -> None:
        scope, tests = self.workqueue.popitem(last=from_end)
        self.assigned_work.setdefault(node, {})[scope] = tests
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in tests.items() if not done])
