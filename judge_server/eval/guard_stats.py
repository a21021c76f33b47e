"""The deterministic guards (judge_server.guards) measured offline on labelled steps, and the defaults that implies.

Contract:
- Every rule of ``GUARD_RULES`` runs on every labelled step, on the same (context, response, next_state, tools)
  split the judge gets (dataset.LabelledStep.guarded), whatever its configured action.
- Per rule (:class:`RuleStats`): how often it fires, on steps labelled +1 / 0 / -1, its -1 precision (fired =>
  the step is bad) and -1 recall.
- :func:`implied_default` is the one place the defaults rule lives: a rule whose natural action sets a score
  (override, abstain) is on (with that action) only where it fired and its -1 precision is at least
  ``MIN_DEFAULT_PRECISION``; a quarantine rule is on only where the steps held what it reads
  (``judge_server.guards.decidable``) and it never fired on a +1 or 0 step; any other rule is off.
- :func:`guard_verdicts` is the "guards" source: -1 where a rule enabled in the given configuration fires, else +1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from judge_server.eval.dataset import LabelledStep, StepKey
from judge_server.guards import (
    DEFAULT_GUARD_ACTIONS,
    GUARD_RULES,
    MIN_DEFAULT_PRECISION,
    NATURAL_ACTIONS,
    GuardSetting,
    decidable,
    fired_rules,
)


@dataclass(frozen=True)
class RuleStats:
    rule: str
    natural_action: str
    fired_good: int  # fired on steps labelled +1
    fired_neutral: int  # ... 0
    fired_bad: int  # ... -1
    bad_steps: int  # steps labelled -1 in all
    decidable: int  # steps holding what the rule reads (judge_server.guards.decidable)

    @property
    def fired(self) -> int:
        return self.fired_good + self.fired_neutral + self.fired_bad

    @property
    def bad_precision(self) -> float | None:
        """P(step labelled -1 | the rule fired); None when it never fired."""
        return self.fired_bad / self.fired if self.fired else None

    @property
    def bad_recall(self) -> float | None:
        """P(the rule fired | step labelled -1); None without -1 steps."""
        return self.fired_bad / self.bad_steps if self.bad_steps else None


def measure_guards(steps: Sequence[LabelledStep]) -> list[RuleStats]:
    """One :class:`RuleStats` per rule of ``GUARD_RULES``, in that order."""
    counts = {rule: {1: 0, 0: 0, -1: 0} for rule in GUARD_RULES}
    readable = dict.fromkeys(GUARD_RULES, 0)
    for step in steps:
        guarded = step.guarded()
        for rule in fired_rules(guarded):
            counts[rule][step.label] += 1
        for rule in GUARD_RULES:
            readable[rule] += decidable(rule, guarded)
    bad = sum(1 for s in steps if s.label == -1)
    return [
        RuleStats(rule, NATURAL_ACTIONS[rule], counts[rule][1], counts[rule][0], counts[rule][-1], bad, readable[rule])
        for rule in GUARD_RULES
    ]


def implied_default(stats: RuleStats) -> GuardSetting:
    """The default setting the rule's measurement supports (module contract)."""
    if stats.natural_action == "quarantine":
        return "quarantine" if stats.decidable and stats.fired_good + stats.fired_neutral == 0 else "off"
    precision = stats.bad_precision
    if precision is not None and precision >= MIN_DEFAULT_PRECISION:
        return "override" if stats.natural_action == "override" else "abstain"
    return "off"


def guard_verdicts(
    steps: Sequence[LabelledStep], actions: Mapping[str, str] = DEFAULT_GUARD_ACTIONS
) -> dict[StepKey, int]:
    """-1 where a rule that ``actions`` enables (not ``off``) fires on the step, else +1."""
    enabled = [rule for rule in GUARD_RULES if actions.get(rule, "off") != "off"]
    return {step.key: -1 if fired_rules(step.guarded(), enabled) else 1 for step in steps}
