"""Server processes for tests and benches: engine.procs' helpers, with every process tied to this one.

Each process is started in a process group of its own with a parent-death signal (``die_with_parent``), so
whatever this Python process is (pytest, a bench) and however it ends (an exception, Ctrl-C, ``kill -9``),
the kernel kills what it started; ``ManagedProcess.stop`` stops the whole group. The names mirror
engine.procs, so a test imports them from here and nothing else changes.
"""

from __future__ import annotations

from functools import partial

import httpx

from engine import procs as _procs
from engine.procs import ManagedProcess, free_port, wait_http

spawn = partial(_procs.spawn, die_with_parent=True)
start_process = partial(_procs.start_process, die_with_parent=True)
start_dev_engine = partial(_procs.start_dev_engine, die_with_parent=True)
start_router = partial(_procs.start_router, die_with_parent=True)


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples ``name`` at ``url/metrics`` whose labels include ``labels`` (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


__all__ = [
    "ManagedProcess",
    "free_port",
    "metric_value",
    "spawn",
    "start_dev_engine",
    "start_process",
    "start_router",
    "wait_http",
]
