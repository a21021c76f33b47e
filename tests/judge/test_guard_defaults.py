"""The guards' defaults follow their measurement (judge_server.guards.DEFAULT_GUARD_ACTIONS vs hindsight-judge-eval).

Every rule is re-measured on AgentProcessBench's 597 labelled steps (judge_server.eval.guard_stats) and
``implied_default`` (the one rule: a score-setting rule needs -1 precision >= MIN_DEFAULT_PRECISION, a quarantine
rule must never fire on a +1 or 0 step) must give each rule's configured default; the rule itself is pinned on
hand-made measurements.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from judge_server.eval.dataset import load_dataset
from judge_server.eval.guard_stats import RuleStats, guard_verdicts, implied_default, measure_guards
from judge_server.guards import DEFAULT_GUARD_ACTIONS, GUARD_RULES, MIN_DEFAULT_PRECISION

pytestmark = pytest.mark.unit

DATASET = Path(__file__).resolve().parents[2] / "bench" / "data" / "agentprocessbench" / "hotpotqa.dev.jsonl"


def test_defaults_follow_the_measurement() -> None:
    steps = load_dataset(DATASET)
    stats = measure_guards(steps)
    assert [s.rule for s in stats] == list(GUARD_RULES)
    assert all(s.bad_steps == 160 for s in stats)
    implied = {s.rule: implied_default(s) for s in stats}
    assert implied == DEFAULT_GUARD_ACTIONS, [s for s in stats if implied[s.rule] != DEFAULT_GUARD_ACTIONS[s.rule]]


def test_guards_source_marks_bad_where_an_enabled_rule_fires() -> None:
    steps = load_dataset(DATASET)
    fired = {s.rule: s.fired for s in measure_guards(steps)}
    everything_on = dict.fromkeys(GUARD_RULES, "override")
    marked = sum(1 for v in guard_verdicts(steps, everything_on).values() if v == -1)
    # at least the busiest rule's steps, at most all rules' firings together
    assert max(fired.values()) <= marked <= sum(fired.values())
    assert set(guard_verdicts(steps, dict.fromkeys(GUARD_RULES, "off")).values()) == {1}


def _stats(action: str, good: int, neutral: int, bad: int, decidable: int = 597) -> RuleStats:
    return RuleStats("r", action, good, neutral, bad, bad_steps=100, decidable=decidable)


@pytest.mark.parametrize(
    ("stats", "expected"),
    [
        (_stats("override", 1, 0, 4), "override"),  # precision 0.8: on
        (_stats("override", 1, 1, 4), "off"),  # 0.67
        (_stats("abstain", 0, 0, 3), "abstain"),
        (_stats("override", 0, 0, 0), "off"),  # never fired: no evidence
        (_stats("quarantine", 0, 0, 0), "quarantine"),  # read every step, never fired: nothing against it
        (_stats("quarantine", 0, 0, 0, decidable=0), "off"),  # nothing to read: not measured
        (_stats("quarantine", 0, 0, 9), "quarantine"),
        (_stats("quarantine", 0, 1, 50), "off"),  # once on a neutral step is once too many
    ],
)
def test_implied_default(stats: RuleStats, expected: str) -> None:
    assert MIN_DEFAULT_PRECISION == 0.8  # the figures above straddle it
    assert implied_default(stats) == expected
