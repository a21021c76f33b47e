"""The layout pages name what exists: README.md's layout paragraph, docs/FLOW.md and docs/CONTRACTS.md, read as text
and checked against the source tree with ``ast`` (nothing is imported).

What is checked is what a reader follows, written in backticks:

- a path: each ``.py`` file, and each folder (``name/``) whose first part is a folder of the repository root or
  of a package in it (``policy_server/api/``, ``chat/``), is a file or folder of the tree, written from the root or
  from inside a package (``serving/chat_turn.py`` is policy_server/serving/chat_turn.py);
- a function after a file (```file.py` (`name`)``, ```file.py` (`Class.method`)``) is defined in that file;
- a dotted name under a top-level package (``engine.records.Sample``, ``trainer.lease_client.typed_samples``) is a
  module, or names a definition in the module it starts with (a class, a function, an assignment, an import);
- every top-level folder of the repository (hidden ones and build output aside) is named in README.md's layout
  paragraph and in CONTRACTS.md's layout table.

Placeholders (``tests/<area>/``, ``step_XXXXXX/``, globs) and folders of a run's output (``tensorboard/``) are not
paths of the tree and are left alone.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/FLOW.md", "docs/CONTRACTS.md")
SKIPPED_DIRS = {"__pycache__", "node_modules"}
FILE_SUFFIXES = {"py", "md", "sh", "json", "jsonl", "yaml", "yml", "toml", "j2", "jinja", "mjs", "txt", "html"}
PATH = re.compile(r"`([A-Za-z0-9_./-]+(?:\.py|/))`(?:\s*\(`([A-Za-z_][A-Za-z0-9_.]*)`)?")
DOTTED = re.compile(r"`([a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)+)[`(]")


def top_level_dirs() -> list[str]:
    """The repository's own top-level folders: not hidden, not build output (``*.egg-info``, build/, dist/)."""
    return sorted(
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".egg-info") and p.name not in SKIPPED_DIRS
        if p.name not in {"build", "dist", "runs"}
    )


@cache
def tree() -> frozenset[str]:
    """Every file and folder of the repository's own folders, as root-relative paths (folders end in ``/``)."""
    found: set[str] = set()
    for top in top_level_dirs():
        for path in (ROOT / top).rglob("*"):
            if SKIPPED_DIRS & set(path.relative_to(ROOT).parts):
                continue
            rel = path.relative_to(ROOT).as_posix()
            found.add(rel + "/" if path.is_dir() else rel)
        found.add(top + "/")
    return frozenset(found)


@cache
def package_dir_names() -> frozenset[str]:
    """Names of the root's folders and of every folder inside a package: the first part of a checked folder path."""
    names = set(top_level_dirs())
    names |= {Path(p).name for p in tree() if p.endswith("/") and (ROOT / p / "__init__.py").exists()}
    names |= {Path(p).name for p in tree() if p.endswith("/") and (ROOT / p).parent.joinpath("__init__.py").exists()}
    return frozenset(names)


def resolve(path: str) -> list[str]:
    """The tree's paths that ``path`` names: itself from the root, or the same path inside a folder."""
    return sorted(p for p in tree() if p == path or p.endswith("/" + path))


def is_placeholder(token: str) -> bool:
    return any(c in token for c in "<>*{}") or re.search(r"[A-Z]{3,}", token) is not None


def paths_in(text: str) -> Iterator[tuple[int, str, str | None]]:
    """(line, path, the function named after it or None) for each checked path of a page."""
    for m in PATH.finditer(text):
        token, name = m.group(1), m.group(2)
        if is_placeholder(token) or token.startswith(("http", "~", "/")):
            continue
        if token.endswith("/") and token.split("/")[0] not in package_dir_names():
            continue  # a folder of something else (a run's output, another project)
        yield text.count("\n", 0, m.start()) + 1, token, name


def defined_names(source: str) -> set[str]:
    """Every name defined anywhere in a module, methods and class attributes included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_problem(name: str, packages: set[str]) -> str | None:
    """Why the dotted ``name`` names nothing (None when it does, or when it is no name of ours)."""
    parts = name.split(".")
    if parts[0] not in packages or parts[-1] in FILE_SUFFIXES:
        return None
    for i in range(len(parts), 0, -1):
        if (found := module_file(parts[:i])) is not None:
            if i == len(parts) or parts[i] in defined_names(found.read_text(encoding="utf-8")):
                return None
            return f"{'.'.join(parts[:i])} defines no {parts[i]}"
    return "no such module"


def problems(page: str, text: str) -> Iterator[str]:
    for line, path, name in paths_in(text):
        hits = resolve(path)
        if not hits:
            yield f"{page}:{line}: `{path}` is no file or folder"
        elif name is not None and path.endswith(".py"):
            want = name.split(".")[-1]
            if not any(want in defined_names((ROOT / h).read_text(encoding="utf-8")) for h in hits):
                yield f"{page}:{line}: `{path}` defines no `{name}`"
    packages = {d for d in top_level_dirs() if (ROOT / d / "__init__.py").exists()}
    for m in DOTTED.finditer(text):
        if (why := dotted_problem(m.group(1), packages)) is not None:
            yield f"{page}:{text.count(chr(10), 0, m.start()) + 1}: `{m.group(1)}`: {why}"


def test_the_check_finds_what_does_not_exist() -> None:
    """The check itself: a moved file, a renamed function, a missing module attribute and a missing folder are each
    found; placeholders, output folders and what exists are not."""
    text = (
        "`serving/chat_turn.py` (`check_backlog`), `serving/chat_turn.py` (`no_such_step`), `serving/gone.py`,\n"
        "`policy_server/api/chat/`, `policy_server/gateway/`, `tests/<area>/`, `step_XXXXXX/`, `tensorboard/`,\n"
        "`engine.records.Sample`, `engine.records.NoSuchRecord`, `engine.no_such_module`, `prm.yaml`.\n"
    )
    assert list(problems("page", text)) == [
        "page:1: `serving/chat_turn.py` defines no `no_such_step`",
        "page:1: `serving/gone.py` is no file or folder",
        "page:2: `policy_server/gateway/` is no file or folder",
        "page:3: `engine.records.NoSuchRecord`: engine.records defines no NoSuchRecord",
        "page:3: `engine.no_such_module`: engine defines no no_such_module",
    ]


@pytest.mark.parametrize("page", PAGES)
def test_the_page_names_what_exists(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert len(list(paths_in(text))) > 5
    assert list(problems(page, text)) == []


def test_the_layout_pages_name_every_top_level_folder() -> None:
    folders = top_level_dirs()
    assert {"engine", "policy_server", "devkit", "prm", "tests", "docs"} <= set(folders)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("Layout:") :].split("\n\n")[0]
    table = (ROOT / "docs" / "CONTRACTS.md").read_text(encoding="utf-8").split("## Layout")[1].split("\n## ")[0]
    assert [f for f in folders if f"`{f}/`" not in layout] == []
    assert [f for f in folders if f"| `{f}/` |" not in table and f"| `{f}/<area>/` |" not in table] == []
