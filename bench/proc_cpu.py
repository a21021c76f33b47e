"""CPU time of another process (a server under a bench), read from Linux /proc.

Role: the benches' one reader of a server process's CPU. :func:`process_cpu_s` is the process's user + system
time from ``/proc/PID/stat``: every thread it ever ran included, counted in clock ticks (10 ms), so it suits
windows of seconds. :class:`ThreadCpu` reads each live thread's time on a CPU from ``/proc/PID/task/TID/schedstat``
in nanoseconds, so one turn of a few milliseconds is measured exactly rather than as 0 or 1 tick; a thread that
ends inside a window takes its time in that window with it, which suits short windows over long-lived threads
(a server's event loop and worker pool). Where the kernel keeps no schedstat it falls back to the ticks.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, every thread included (Linux /proc, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadCpu:
    """CPU time of one process's threads, in nanoseconds (see the module docstring)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exact = Path(f"/proc/{pid}/task/{pid}/schedstat").exists()

    def read(self) -> dict[int, int]:
        """Each live thread's CPU time so far, ns, by thread id (without schedstat: the process's ticks as one)."""
        if not self.exact:
            return {0: round(process_cpu_s(self.pid) * 1e9)}
        out = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # the thread ended while the folder was read
                continue
        return out

    def since(self, before: dict[int, int]) -> float:
        """CPU seconds the process's threads spent since ``before`` (a :meth:`read`); a thread started since
        counts from zero."""
        now = self.read()
        return sum(ns - before.get(tid, 0) for tid, ns in now.items()) / 1e9
