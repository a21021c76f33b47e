"""The guards' default actions follow their measurement on AgentProcessBench's labelled HotpotQA steps.

Contract (judge_server.guards, "Defaults"): every rule is re-measured on each labelled assistant step of
``bench/data/agentprocessbench/hotpotqa.dev.jsonl`` (context = the messages before it, response = it, next
state = the messages after it up to the next assistant message, tools = the row's tools). A rule whose
natural action sets a score (override, abstain) is on by default only when it fires and its -1 precision
(share of its firings on steps labelled -1) is at least ``MIN_DEFAULT_PRECISION``; a quarantine rule is on
only when it never fires on a step labelled +1 or 0. ``DEFAULT_GUARD_ACTIONS`` must be exactly what the
measurement implies, so a changed rule or threshold that moves a figure fails here until the default moves too.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from judge_server.guards import (
    DEFAULT_GUARD_ACTIONS,
    GUARD_RULES,
    MIN_DEFAULT_PRECISION,
    NATURAL_ACTIONS,
    GuardedStep,
    fired_rules,
)

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "agentprocessbench" / "hotpotqa.dev.jsonl"
LABELLED_STEPS = 597  # the data set's README: 200 trajectories, 597 labelled steps


def labelled_steps(path: Path) -> list[tuple[GuardedStep, int]]:
    """Each labelled assistant step of the file as the guards read it, with its label (+1, 0, -1)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row: dict[str, Any] = json.loads(line)
        messages = row["messages"]
        for index, label in row["step_labels"].items():
            i = int(index)
            assert messages[i]["role"] == "assistant", (row["total_index"], i)
            after = messages[i + 1 :]
            end = next((k for k, m in enumerate(after) if m["role"] == "assistant"), len(after))
            step = GuardedStep(context=messages[:i], response=messages[i], next_state=after[:end], tools=row["tools"])
            out.append((step, int(label)))
    return out


def implied_default(rule: str, fired_by_label: Counter[int]) -> str:
    """The default the measurement implies for ``rule`` (its natural action, or off)."""
    action = NATURAL_ACTIONS[rule]
    if action == "quarantine":
        return action if fired_by_label[1] + fired_by_label[0] == 0 else "off"
    fired = sum(fired_by_label.values())
    return action if fired and fired_by_label[-1] / fired >= MIN_DEFAULT_PRECISION else "off"


@pytest.fixture(scope="module")
def measured() -> dict[str, Counter[int]]:
    steps = labelled_steps(DATA)
    assert len(steps) == LABELLED_STEPS
    counts: dict[str, Counter[int]] = {rule: Counter() for rule in GUARD_RULES}
    for step, label in steps:
        for rule in fired_rules(step):
            counts[rule][label] += 1
    return counts


def test_every_default_follows_the_measurement(measured: dict[str, Counter[int]]) -> None:
    implied = {rule: implied_default(rule, measured[rule]) for rule in GUARD_RULES}
    figures = {rule: dict(measured[rule]) for rule in GUARD_RULES}
    assert implied == DEFAULT_GUARD_ACTIONS, f"firings by label: {figures}"


def test_the_decision_rule_itself() -> None:
    """Hand-made counts: the precision bound is inclusive, a quarantine rule is off after one +1 or 0 firing."""
    assert implied_default("tool_error", Counter({-1: 4, 1: 1})) == "override"  # 0.8 >= 0.8
    assert implied_default("tool_error", Counter({-1: 3, 1: 2})) == "off"
    assert implied_default("tool_error", Counter()) == "off"  # never fired: no evidence
    assert implied_default("degenerate", Counter({-1: 9})) == "quarantine"
    assert implied_default("degenerate", Counter()) == "quarantine"
    assert implied_default("degenerate", Counter({-1: 9, 0: 1})) == "off"


def test_the_measurement_sees_the_rules_fire(measured: dict[str, Counter[int]]) -> None:
    """The data does exercise the guards (a loader that built empty steps would make every rule silent)."""
    assert sum(measured["tool_error"].values()) > 0
    assert sum(measured["malformed_tool_call"].values()) > 0
