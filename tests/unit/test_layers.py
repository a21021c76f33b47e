"""The import layering of the production packages, read from the source with ``ast`` (nothing is imported).

Contract (docs/FLOW.md): ``policy_server.api`` (the HTTP shapes) depends on ``policy_server.serving``
(sessions, generation, records), never the reverse. Only the API package itself and the composition root
(``policy_server.app``, which wires routes, and ``policy_server.cli``) import ``policy_server.api``: no module of
serving, rewards, store or the shared policy-server modules does, and neither does ``engine``, the judge or the
trainer. ``engine`` imports no service at all. Every import counts: module level, inside functions, and
under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
API = "policy_server.api"
API_IMPORTERS = {"policy_server.app", "policy_server.cli"}  # the composition root
SERVICES = ("policy_server", "judge_server", "trainer")


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


def test_engine_imports_no_service() -> None:
    assert offenders(modules("engine"), SERVICES) == []
