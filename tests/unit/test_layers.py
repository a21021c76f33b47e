"""The import layering of the production packages, read from the source with ``ast`` (nothing is imported).

Contract (docs/FLOW.md): ``policy_server.api`` is grouped by API shape (``chat/``, ``responses/``, ``messages/``:
the two adapters may use the chat shape, never each other) with the trainer's lease protocol apart (``lease.py``,
no shape); it depends on ``policy_server.serving`` (sessions, generation, records), never the reverse. Only the API package itself and the composition root
(``policy_server.app``, which wires routes, and ``policy_server.cli``) import ``policy_server.api``: no module of
serving, rewards, store or the shared policy-server modules does, and neither does ``engine``, the judge or the
trainer. ``engine`` imports no service at all, production imports nothing of ``devkit`` (the development tooling,
which imports ``engine`` and no service), and the judge service does not import ``prm`` (the scorer
framework). Every import counts: module level, inside functions, and
under ``TYPE_CHECKING``.

No import circles among the production packages (``engine``, ``policy_server``, ``judge_server``, ``trainer``,
``prompts``, ``prm``) and ``devkit``, at every grain:

- modules: no two modules reach each other through imports;
- rooms: a service's subpackage (``policy_server.store``, ``trainer.lease_client``) or one of its top-level
  modules (``policy_server.state``, ``trainer.settings``) is one room; no two rooms reach each other;
- the grains around them: the top-level packages themselves, and below the rooms each deeper level of
  subpackages (``policy_server.api.chat`` is one node of the third grain, ``policy_server.api.lease`` another).

"Reach" is through any number of imports: a circle of three rooms (a imports b, b imports c, c imports a) is one
as much as two rooms importing each other; the check finds the strongly connected parts of each grain's graph.

The lease client (``trainer.lease_client``) is the library other trainers (verl, slime, a user's loop) import: it
imports nothing of this repository but itself and ``engine``, so the trainer package and its lease client form no
circle either (the trainer's own reading of a sample as tensors is ``trainer.sample_tensors``, beside it).

A ``TYPE_CHECKING`` or function-level import counts like any other: it does not run at import time, but it
is a dependency a reader has to hold in mind, and a circle hidden that way is still a circle (the cure is a
protocol in the lower module, or the shared definition moved down). An import names the most specific
production module it reaches (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``); the
parent packages Python runs on the way are not counted, so a submodule importing its sibling does not
circle through the package ``__init__`` that re-exports both.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
API = "policy_server.api"
API_IMPORTERS = {"policy_server.app", "policy_server.cli"}  # the composition root
SERVICES = ("policy_server", "judge_server", "trainer")
PRODUCTION = ("engine", "policy_server", "judge_server", "trainer", "prompts", "prm")
DEVKIT = "devkit"  # development tooling: tests, benches and the dev stack import it, production never does


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module ``source`` (the text of ``module``) imports (``from a import b`` gives ``a`` and ``a.b``),
    relative imports resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            yield name
            yield from (f"{name}.{alias.name}" for alias in node.names)


def imported_modules(path: Path) -> Iterator[str]:
    return imports_of(path.read_text(encoding="utf-8"), module_name(path), is_package=path.name == "__init__.py")


def modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offenders_in(imports: dict[str, set[str]], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {name}"
        for module, names in imports.items()
        for name in sorted(names)
        if any(within(name, f) for f in forbidden)
    ]


def offenders(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return offenders_in({module_name(p): set(imported_modules(p)) for p in paths}, forbidden)


def test_the_parser_sees_imports_of_every_form() -> None:
    """The check itself: absolute, from-, relative, function-level and TYPE_CHECKING imports are all seen."""
    source = (
        "from typing import TYPE_CHECKING\nimport policy_server.api.routes\nfrom ..api import streaming\n"
        "def f():\n    from policy_server import api\nif TYPE_CHECKING:\n    from policy_server.api.x import Y\n"
    )
    names = set(imports_of(source, "policy_server.serving.probe"))
    assert {
        "policy_server.api.routes",
        "policy_server.api.streaming",
        "policy_server.api",
        "policy_server.api.x",
    } <= names
    assert offenders_in({"policy_server.serving.probe": names}, (API,))


def test_only_the_api_and_the_composition_root_import_the_api() -> None:
    below = [p for p in modules("policy_server") if not within(module_name(p), API)]
    below = [p for p in below if module_name(p) not in API_IMPORTERS]
    assert {module_name(p) for p in below} >= {"policy_server.serving.chat_turn", "policy_server.errors"}
    assert offenders(below, (API,)) == []
    assert offenders(modules("engine", "judge_server", "trainer"), (API,)) == []


SHAPES = {shape: f"{API}.{shape}" for shape in ("chat", "responses", "messages")}
SHAPE_USES = {"chat": (), "responses": ("chat",), "messages": ("chat",)}  # the adapters run a chat turn


def test_each_api_shape_keeps_to_itself() -> None:
    """``api/`` is grouped by API shape: the Responses and Messages adapters may use the chat shape (they run a
    chat turn) but never each other, the chat shape uses neither, and the trainer's lease protocol
    (``api/lease.py``) uses no shape at all."""
    for shape, package in SHAPES.items():
        others = tuple(p for s, p in SHAPES.items() if s != shape and s not in SHAPE_USES[shape])
        assert modules(package.replace(".", "/")), package
        assert offenders(modules(package.replace(".", "/")), others) == []
    assert offenders([ROOT / "policy_server/api/lease.py"], tuple(SHAPES.values())) == []


def test_engine_imports_no_service() -> None:
    assert offenders(modules("engine"), SERVICES) == []


def test_production_imports_no_development_tooling() -> None:
    assert {module_name(p) for p in modules(DEVKIT)} >= {"devkit.dev_server.cli", "devkit.tiny_model"}
    assert offenders(modules(*PRODUCTION), (DEVKIT,)) == []
    assert offenders(modules(DEVKIT), SERVICES) == []


def test_the_judge_service_does_not_import_the_scorer_framework() -> None:
    """``prm`` (the scorer framework) serves the policy server and the trainer; the judge service never loads it."""
    assert offenders(modules("judge_server"), ("prm",)) == []


# ----------------------------------------------------------------------------- import circles
def import_graph(imports: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """``module -> modules it imports``, each imported name resolved to the most specific module of ``imports``
    (names outside them, the standard library and third parties, are dropped; so is a module importing itself)."""
    known = set(imports)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {r for n in names if (r := resolve(n)) is not None and r != m} for m, names in imports.items()}


def at_grain(module: str, depth: int) -> str:
    """The node of ``module`` at a grain: its first ``depth`` name parts (the top-level package at 1, the room at 2;
    a module shallower than that is its own node)."""
    return ".".join(module.split(".")[:depth])


def grain_graph(graph: Mapping[str, set[str]], depth: int) -> dict[str, set[str]]:
    """``graph`` with every module replaced by its node at ``depth`` (:func:`at_grain`), imports inside one node
    dropped."""
    nodes: dict[str, set[str]] = {at_grain(m, depth): set() for m in graph}
    for module, names in graph.items():
        node = at_grain(module, depth)
        nodes[node] |= {at_grain(n, depth) for n in names} - {node}
    return nodes


def room_of(module: str) -> str:
    """The room of a module: its service's subpackage or top-level module (the first two name parts)."""
    return at_grain(module, 2)


def room_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    return grain_graph(graph, 2)


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one node (each sorted), i.e. every import
    circle; an acyclic graph has none. Tarjan's algorithm, iterative (no recursion limit on a deep chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return sorted(found)


def production_graph() -> dict[str, set[str]]:
    return import_graph({module_name(p): set(imported_modules(p)) for p in modules(*PRODUCTION, DEVKIT)})


def test_the_circle_check_finds_circles_at_every_grain() -> None:
    """The check itself: a two-module circle (one side only under TYPE_CHECKING), a longer one, and a circle
    between rooms whose modules form none are each found; an acyclic graph has none."""
    sources = {
        "svc.a.x": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from svc.a.y import Y\n",
        "svc.a.y": "from svc.a import x\n",
        "svc.b.p": "from svc.b.q import Q\n",
        "svc.b.q": "def f():\n    from svc.c import r\n",
        "svc.c.r": "import svc.b.p\n",
        "svc.d.s": "from svc.e.t import T\n",
        "svc.e.t": "import json\n",
        "svc.e.u": "from svc.d.s import S\n",
        "svc.f": "from svc.d.s import S\nimport svc.e.t\n",
    }
    graph = import_graph({m: set(imports_of(src, m)) for m, src in sources.items()})
    assert circles(graph) == [["svc.a.x", "svc.a.y"], ["svc.b.p", "svc.b.q", "svc.c.r"]]
    rooms = room_graph(graph)
    assert circles(rooms) == [["svc.b", "svc.c"], ["svc.d", "svc.e"]]
    del graph["svc.a.x"], graph["svc.c.r"], graph["svc.e.u"]
    assert circles(room_graph(graph)) == [] and circles(graph) == []


def test_the_circle_check_finds_long_circles_and_deeper_ones() -> None:
    """The check itself: three rooms in a ring (no two of them import each other, their modules form no circle)
    are one circle at the room grain; a ring of three top-level packages whose rooms form none is one at the first
    grain; a ring of two subpackages inside one room is one at the third grain, where the room grain sees one node."""
    sources = {
        "svc.g.a": "from svc.h.b import B\n",
        "svc.h.b": "import json\n",
        "svc.h.c": "from svc.i import d\n",
        "svc.i": "def f():\n    from svc.g.e import E\n",
        "svc.g.e": "import json\n",
        "top1.m": "import top2.m\n",
        "top2.m": "import top3.m\n",
        "top3.m": "import json\n",
        "top3.n": "import top1\n",
        "top1": "import json\n",
        "svc.j.p.x": "from svc.j.q.y import Y\n",
        "svc.j.q.y": "import json\n",
        "svc.j.q.z": "from svc.j.p.w import W\n",
        "svc.j.p.w": "import json\n",
    }
    graph = import_graph({m: set(imports_of(src, m)) for m, src in sources.items()})
    assert circles(graph) == []
    rooms = room_graph(graph)
    assert all(a not in rooms[b] for a in rooms for b in rooms[a])  # no two rooms import each other
    assert circles(rooms) == [["svc.g", "svc.h", "svc.i"]]
    assert circles(grain_graph(graph, 1)) == [["top1", "top2", "top3"]]
    assert circles(grain_graph(graph, 3)) == [["svc.j.p", "svc.j.q"]]


def test_no_module_imports_itself_back() -> None:
    graph = production_graph()
    assert {"policy_server.store.sessions", "trainer.train", "prm.scorer"} <= set(graph)
    assert circles(graph) == []


def test_no_room_imports_itself_back() -> None:
    rooms = room_graph(production_graph())
    assert {"policy_server.store", "policy_server.rewards", "policy_server.state", "trainer.lease_client"} <= set(rooms)
    assert circles(rooms) == []


def test_no_circle_at_any_grain() -> None:
    """From the top-level packages down to the modules, every grain is free of circles."""
    graph = production_graph()
    deepest = max(len(m.split(".")) for m in graph)
    assert deepest >= 4 and {"policy_server.api.chat", "policy_server.store.rows"} <= set(grain_graph(graph, 3))
    found = {depth: c for depth in range(1, deepest + 1) if (c := circles(grain_graph(graph, depth)))}
    assert found == {}


def test_the_lease_client_stands_alone() -> None:
    """Other trainers import ``trainer.lease_client`` without the trainer: it reaches only itself and ``engine``."""
    lease_client = modules("trainer/lease_client")
    assert {module_name(p) for p in lease_client} >= {"trainer.lease_client.client", "trainer.lease_client.samples"}
    graph = production_graph()
    outside = {
        f"{module_name(p)} imports {name}"
        for p in lease_client
        for name in graph[module_name(p)]
        if not within(name, "trainer.lease_client") and not within(name, "engine")
    }
    assert outside == set()
