"""The sample store speaks records: no public method of the store takes or returns a dict.

Read from the source with ``ast`` (nothing is imported), over the role classes ``SampleStore`` is assembled
from (policy_server/store/__init__.py) and their base ``StoreDB``: every public method's parameter and
return annotations. An annotation that names ``dict``, ``Mapping``, ``SampleJSON`` or ``Any`` is a dict
in disguise (``Any`` hides one as well as anything else). The JSON of a row is built only in the row-mapping
module (policy_server/store/rows.py) and the records (engine.records, policy_server/store/records.py) are what
crosses the store's edge.

No method is excepted: a new one that takes or returns a dict fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "policy_server" / "store"
ROLE_CLASSES = {
    "StoreDB",
    "StoreSessions",
    "StoreSamples",
    "StoreLeases",
    "StoreReads",
    "StoreResponses",
    "StoreFeedback",
    "StorePrivacy",
    "StoreVersions",
    "SampleStore",
}
DICT_NAMES = {"dict", "Dict", "Mapping", "MutableMapping", "SampleJSON", "Any"}


def _names(node: ast.expr | None) -> set[str]:
    """Every name an annotation mentions (``dict[str, Any] | None`` gives dict, str, Any), string
    annotations (``from __future__ import annotations`` keeps them as written) parsed first."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _names(ast.parse(node.value, mode="eval").body)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def dict_methods(source: str) -> dict[str, list[str]]:
    """``Class.method -> the annotations that name a dict`` for each public method of the role classes."""
    found: dict[str, list[str]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef) or cls.name not in ROLE_CLASSES:
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name.startswith("_"):
                continue
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            annotated = [(a.arg, a.annotation) for a in args] + [("return", fn.returns)]
            bad = [f"{name}: {ast.unparse(ann)}" for name, ann in annotated if _names(ann) & DICT_NAMES]
            if bad:
                found[f"{cls.name}.{fn.name}"] = bad
    return found


def store_dict_methods() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(STORE.glob("*.py")):
        found.update(dict_methods(path.read_text(encoding="utf-8")))
    return found


def test_the_check_sees_dicts_in_every_annotation_form() -> None:
    source = (
        "from typing import Any\n"
        "class StoreSessions:\n"
        "    def get_turn(self, sid: str) -> 'dict[str, Any] | None': ...\n"
        "    def put(self, rows: list[Mapping[str, int]]) -> None: ...\n"
        "    def value(self, key: str) -> Any: ...\n"
        "    def turn(self, sid: str) -> Turn | None: ...\n"
        "    def _private(self) -> dict[str, int]: ...\n"
        "class Helper:\n"
        "    def rows(self) -> dict[str, int]: ...\n"
    )
    assert dict_methods(source) == {
        "StoreSessions.get_turn": ["return: 'dict[str, Any] | None'"],
        "StoreSessions.put": ["rows: list[Mapping[str, int]]"],
        "StoreSessions.value": ["return: Any"],
    }


def test_the_turn_methods_speak_records() -> None:
    found = store_dict_methods()
    for method in ("StoreSessions.get_turn", "StoreSessions.awaiting_turn", "StoreSessions.record_turn"):
        assert method not in found, found.get(method)


def test_no_public_store_method_takes_or_returns_a_dict() -> None:
    found = store_dict_methods()
    # The scan reads the store: a moved folder, or a role class renamed, must not pass empty.
    assert len(list(STORE.glob("*.py"))) > 5 and all(
        f"class {name}" in "".join(p.read_text(encoding="utf-8") for p in STORE.glob("*.py")) for name in ROLE_CLASSES
    )
    assert found == {}, found
