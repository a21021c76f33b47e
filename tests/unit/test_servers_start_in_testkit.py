"""Test servers start only through the test kit (tests/testkit), read from the test sources with ``ast``.

The rule, for every Python module under tests/ outside tests/testkit:

- it launches no process of its own that outlives the call: no ``subprocess.Popen``, no
  ``asyncio.create_subprocess_exec``/``_shell``, no ``os.fork``/``posix_spawn``/``system``, no
  ``multiprocessing.Process``, no ``uvicorn`` (neither imported nor run), and none of the raw starters that take a
  command line (``start_process``, ``spawn``, ``popen_launch`` of engine.procs or tests.testkit.procs, the fork
  server's ``launch``), nor devkit's own starters (``devkit.engine_procs``, ``PgCluster.start``). A server comes
  from a test-kit starter (``start_dev_engine``, ``start_router``, ``start_judge``, ``start_policy``,
  ``start_stack``, ``start_openai_stub``, ``start_pg_cluster``, ...), which ties it to the test run;
- it defines no starter of its own: no function named ``start_*`` or ``_start_*``;
- ``subprocess.run`` is allowed: it returns only once the process has ended, so nothing is left running, and what
  it tests is a command's exit status and output (a CLI refusing bad flags, a launch script's dry run).

The exceptions are tests whose SUBJECT is process handling itself, where starting the process by hand is the point:
each is listed in :data:`ALLOWED` with the name it uses and why. An entry no longer used fails too, so the list
cannot outgrow the code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TESTKIT = TESTS / "testkit"

LAUNCHERS = {
    "subprocess.Popen",
    "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
    "asyncio.subprocess.create_subprocess_exec",
    "asyncio.subprocess.create_subprocess_shell",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.posix_spawnp",
    "os.system",
    "os.popen",
    "pty.spawn",
    "multiprocessing.Process",
    "uvicorn.run",
    "uvicorn.Server",
    "uvicorn.Config",
    "engine.procs.start_process",
    "engine.procs.spawn",
    "engine.procs.popen_launch",
    "tests.testkit.procs.start_process",
    "tests.testkit.procs.spawn",
    "tests.testkit.forkserver.launch",
    "devkit.engine_procs.start_dev_engine",  # the test kit's own are tied to the run; these are not
    "devkit.engine_procs.start_router",
    "devkit.pgcluster.PgCluster.start",
}

# (path under the repository, what it uses): why the test's subject is process handling itself.
ALLOWED = {
    ("tests/unit/test_forkserver.py", "tests.testkit.forkserver.launch"): (
        "the fork server's own contract: a forked service CLI behaves as a fresh process would"
    ),
    ("tests/unit/test_testkit_reaping.py", "subprocess.Popen"): (
        "a stand-in for pytest that the test kills with SIGKILL, to see the test kit's servers die with it"
    ),
    ("tests/reliability/test_guard_units.py", "tests.testkit.procs.spawn"): (
        "spawn's own contract: the log file of a spawned process is private whatever the umask"
    ),
    ("tests/launch/test_cluster_unit.py", "subprocess.Popen"): (
        "an unreaped child (a zombie), which launch's PID bookkeeping must not count as running"
    ),
    ("tests/launch/test_dev_stack.py", "subprocess.Popen"): (
        "processes that are NOT the stack's (a recycled PID, a dying owner): dev.sh stop and the watchdog's PID checks"
    ),
    ("tests/launch/test_gpu_scripts.py", "subprocess.Popen"): (
        "the launch scripts' shared wait-and-kill harness, killed mid-wait to see it stop only what it started"
    ),
    ("tests/launch/test_gpu_scripts.py", "def _start_harness"): "the same harness, started for each of those tests",
    ("tests/launch/test_gpu_scripts_live.py", "subprocess.Popen"): (
        "launch/judge.sh itself: it starts, waits for and stops only its own processes"
    ),
}


def aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it was imported as (``from a import b as c`` gives ``c -> a.b``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    """The dotted name a call's function stands for, its first part resolved through the imports."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([names.get(node.id, node.id), *reversed(parts)])


def launches(source: str) -> Iterator[str]:
    """What ``source`` does that only the test kit may do: each launcher it calls, ``uvicorn`` imported, and
    ``def NAME`` for each starter it defines."""
    tree = ast.parse(source)
    names = aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := dotted(node.func, names)) in LAUNCHERS:
            yield name
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m == "uvicorn" or m.startswith("uvicorn.") for m in modules):
                yield "import uvicorn"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(("start_", "_start_")):
            yield f"def {node.name}"


def test_the_check_sees_every_form() -> None:
    """The check itself: module and from-imports, aliases, nested calls, uvicorn and starters by name are seen;
    ``subprocess.run`` and the test kit's own starters are not launchers."""
    source = (
        "import subprocess, asyncio as aio\nfrom subprocess import Popen as P\nimport uvicorn\n"
        "from tests.testkit.procs import spawn, start_dev_engine\nfrom engine import procs\n"
        "def start_thing():\n    subprocess.Popen(['x'])\n    P(['y'])\n"
        "async def _start_other():\n    await aio.create_subprocess_exec('z')\n"
        "def fixture():\n    spawn('n', [], url='', log_dir=None)\n    procs.start_process('n', [])\n"
        "    uvicorn.run(None)\n    subprocess.run(['ok'])\n    start_dev_engine('m', log_dir=None)\n"
    )
    assert sorted(launches(source)) == sorted(
        [
            "import uvicorn",
            "def start_thing",
            "subprocess.Popen",
            "subprocess.Popen",
            "def _start_other",
            "asyncio.create_subprocess_exec",
            "tests.testkit.procs.spawn",
            "engine.procs.start_process",
            "uvicorn.run",
        ]
    )


def test_servers_start_only_through_the_testkit() -> None:
    paths = sorted(p for p in TESTS.rglob("*.py") if TESTKIT not in p.parents)
    assert len(paths) > 100 and TESTS / "conftest.py" in paths
    found = {(str(p.relative_to(ROOT)), what) for p in paths for what in launches(p.read_text(encoding="utf-8"))}
    assert sorted(found - set(ALLOWED)) == []
    assert sorted(set(ALLOWED) - found) == []  # an allowance nothing uses any more is removed
