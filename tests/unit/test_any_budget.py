"""``Any`` stays rare where the policy server's data is typed: the store, the rewards and the serving packages.

Read from the source with ``ast`` (nothing is imported): every ``Any`` name (``Any``, ``typing.Any``) in the
three packages, annotations and expressions alike, is counted; the count must stay under ``BUDGET``. What
crosses those modules is a record (engine.records, policy_server.store.records), so a new ``Any`` is a dict
in disguise: give it a type instead of raising the budget. A JSON object these modules only pass on or inspect
(a chat message, a tool definition, sampling params) is ``dict[str, object]``: a value is narrowed before use.
What is left is where a value is untyped by nature: a database column (policy_server.store.connection.DBRow) and
the Hugging Face tokenizer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("store", "rewards", "serving")
BUDGET = 60


def any_names(source: str) -> int:
    """How many times ``source`` names ``Any`` (string annotations parsed first)."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "Any" or isinstance(node, ast.Attribute) and node.attr == "Any":
            count += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "Any" in node.value:
            try:
                count += any_names(node.value)
            except SyntaxError:  # a docstring or message that mentions the word, not an annotation
                pass
    return count


def test_the_count_sees_every_spelling() -> None:
    source = (
        "import typing\nfrom typing import Any\n"
        "def f(x: Any, y: 'dict[str, Any]') -> typing.Any:\n"
        "    '''Any text is no annotation.'''\n"
        "    z: list[Any] = []\n"
    )
    assert any_names(source) == 4  # x, the string annotation, the return, z (an import is no use)


def test_any_in_store_rewards_and_serving_stays_under_the_budget() -> None:
    counts = {
        path.relative_to(ROOT).as_posix(): any_names(path.read_text(encoding="utf-8"))
        for package in PACKAGES
        for path in sorted((ROOT / "policy_server" / package).glob("*.py"))
    }
    assert len(counts) > 20  # the scan reads the packages (a moved folder must not pass empty)
    total = sum(counts.values())
    assert total < BUDGET, sorted(((n, p) for p, n in counts.items() if n), reverse=True)
