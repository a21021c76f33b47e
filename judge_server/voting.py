"""Majority voting over judge samples: the fixed (prior-system) rule, the adaptive policy, hint selection.

Contract:
- ``majority_vote(votes)`` (the fixed rule): drop None; no valid vote -> score 0, status ``no_valid_votes``;
  a tie at the top -> score 0, status ``tie``; else the strict plurality value, status ``ok``.
  ``confidence`` = share of the valid votes that agree with the top value (0.0 with no valid vote).
  The status keeps a tie or an all-unparseable result distinguishable from a genuine 0 verdict.
- ``run_policy`` draws votes from a sampler ``sample(k, round_index) -> list[Vote]`` (one engine call
  with n=k per round):
  * ``fixed``: one round of m votes, then the fixed rule.
  * ``adaptive``: rounds sized to the fewest votes that could settle the outcome; stops as soon as
    the m-vote outcome is decided (the leader's count exceeds the runner-up's plus the votes left) with
    at least ``min_valid`` parseable votes; if all m are cast and the result is split, escalates by
    ``escalate_step`` votes at a time up to ``m_max``. Fewer than ``min_valid`` parseable votes at the
    end -> status ``no_valid_votes`` (score 0), whatever the plurality.
  * ``sequential``: a first round of ``first_round`` votes, then one vote per round; stops as soon as the
    current result is ``ok`` with at least ``min_valid`` parseable votes and the probability that the
    votes still missing from the m-vote budget would change it (:func:`change_probability`) is below
    ``stop_change_prob``; a budget spent on a split result escalates like ``adaptive``, up to ``m_max``.
    That is ``stop_rule="change_prob"``; with ``stop_rule="error_budget"`` (the service default) it stops
    instead as soon as the count state is in :func:`judge_server.vote_model.stop_table` for the vote noise
    that ``tracker`` (an :class:`~judge_server.vote_model.AgreementTracker`) has estimated from earlier turns:
    the fewest expected votes whose expected error is at most ``error_budget_share`` times that of fixed
    m-vote voting, up to ``m_max`` votes (no ``budget`` escalation steps); the finished turn's votes then go
    to the tracker (vote_model.py).
- ``select_hint``: the prior rule (longest hint of a +1 vote, stripped, longer than ``min_chars``);
  with ``require_majority`` a hint is only taken when the vote result is ``ok`` with score 1.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from engine.records import STATUS_NO_VALID, STATUS_OK, STATUS_TIE
from judge_server.vote_model import AgreementTracker, state_of, stop_table

StopRule = Literal["error_budget", "change_prob"]  # the sequential policy's stop rules

# The voting knobs' defaults, in this one place: run_policy's keyword defaults and the judge service's settings
# (judge_server.settings.JudgeSettings) both read them, so a caller of either gets the same rule.
MIN_VALID = 1
ESCALATE_STEP = 2
STOP_RULE: StopRule = "error_budget"
STOP_CHANGE_PROB = 0.1
STOP_PRIOR = 0.5
FIRST_ROUND = 2
ERROR_BUDGET_SHARE = 1.0


@dataclass
class Vote:
    """One judge sample: its parsed verdict (None if unparseable), hint and raw text."""

    value: int | None
    hint: str | None = None
    text: str = ""


@dataclass
class VoteResult:
    score: int | None
    status: str
    votes: list[int | None]
    confidence: float
    reason: str | None = None
    rounds: int = 0
    samples: list[Vote] = field(default_factory=list, repr=False)


def majority_vote(votes: Sequence[int | None]) -> VoteResult:
    """The fixed rule (see module docstring)."""
    valid = [v for v in votes if v is not None]
    if not valid:
        return VoteResult(
            score=0, status=STATUS_NO_VALID, votes=list(votes), confidence=0.0, reason="no parseable vote"
        )
    ranked = Counter(valid).most_common()
    top_value, top_count = ranked[0]
    confidence = top_count / len(valid)
    if len(ranked) > 1 and ranked[1][1] == top_count:
        return VoteResult(
            score=0, status=STATUS_TIE, votes=list(votes), confidence=confidence, reason="tie between the top verdicts"
        )
    return VoteResult(score=int(top_value), status=STATUS_OK, votes=list(votes), confidence=confidence)


def _top_two(votes: Sequence[int | None]) -> tuple[int, int, int]:
    valid = [v for v in votes if v is not None]
    counts = sorted(Counter(valid).values(), reverse=True) + [0, 0]
    return counts[0], counts[1], len(valid)


def is_decided(votes: Sequence[int | None], m_total: int, min_valid: int) -> bool:
    """True when no remaining vote of the m_total budget can change the plurality winner."""
    top, second, n_valid = _top_two(votes)
    remaining = max(0, m_total - len(votes))
    return n_valid >= min_valid and top > second + remaining


def next_round_size(votes: Sequence[int | None], m_total: int, min_valid: int) -> int:
    """Fewest extra votes that could decide the m_total outcome (capped at the votes left)."""
    top, second, n_valid = _top_two(votes)
    remaining = max(0, m_total - len(votes))
    if remaining == 0:
        return 0
    # all k new votes going to the leader: top + k > second + remaining - k
    k = (second + remaining - top) // 2 + 1
    k = max(k, min_valid - n_valid, 1)
    return min(k, remaining)


def _compositions(
    total: int, parts: int
) -> Iterator[tuple[int, ...]]:  # every way to put `total` votes in `parts` bins
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


@lru_cache(maxsize=4096)
def _change_probability(leader: int, others: tuple[int, ...], invalid: int, remaining: int, prior: float) -> float:
    counts = (leader, *others, invalid)
    alphas = [c + prior for c in counts]
    total_alpha = sum(alphas)
    # Dirichlet-multinomial predictive of the next `remaining` votes, in log space
    base = math.lgamma(remaining + 1) + math.lgamma(total_alpha) - math.lgamma(total_alpha + remaining)
    p_change = 0.0
    for x in _compositions(remaining, len(counts)):
        log_p = base + sum(
            math.lgamma(a + k) - math.lgamma(a) - math.lgamma(k + 1) for a, k in zip(alphas, x, strict=True)
        )
        final_leader = leader + x[0]
        if any(o + k >= final_leader for o, k in zip(others, x[1:-1], strict=True)):
            p_change += math.exp(log_p)  # another verdict catches up (a tie changes the result too)
    return min(1.0, p_change)


def change_probability(
    votes: Sequence[int | None], remaining: int, outcomes: Sequence[int], prior: float = 0.5
) -> float:
    """Probability that ``remaining`` more votes change the current strict-plurality winner of ``votes``.

    Each vote is a draw from unknown shares of the verdicts in ``outcomes`` plus "unparseable", with a
    symmetric Dirichlet(``prior``) belief updated by the votes so far; the next ``remaining`` votes then follow
    the Dirichlet-multinomial predictive, summed exactly over every split of them. A change is any final
    count where another verdict reaches the leader's count. 1.0 when there is no strict winner yet.
    """
    valid = [v for v in votes if v is not None]
    counts = Counter(valid)
    ranked = counts.most_common()
    if not ranked or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
        return 1.0
    if remaining <= 0:
        return 0.0
    leader_value, leader = ranked[0]
    others = tuple(sorted((counts.get(o, 0) for o in outcomes if o != leader_value), reverse=True))
    return _change_probability(leader, others, len(votes) - len(valid), remaining, prior)


Sampler = Callable[[int, int], Awaitable[list[Vote]]]


async def run_policy(
    sample: Sampler,
    *,
    policy: str,
    m: int,
    m_max: int,
    min_valid: int = MIN_VALID,
    escalate_step: int = ESCALATE_STEP,
    collected: list[Vote] | None = None,
    outcomes: Sequence[int] = (1, 0, -1),
    stop_change_prob: float = STOP_CHANGE_PROB,
    stop_prior: float = STOP_PRIOR,
    first_round: int = FIRST_ROUND,
    stop_rule: str = STOP_RULE,
    tracker: AgreementTracker | None = None,
    error_budget_share: float = ERROR_BUDGET_SHARE,
) -> VoteResult:
    """Draw votes per ``policy`` and aggregate them. ``collected`` receives samples as they arrive, so a
    caller still sees the votes of finished rounds when a later round raises. The sequential policy's
    ``error_budget`` rule (the default) needs ``tracker``; ``stop_rule="change_prob"`` does not."""
    samples = collected if collected is not None else []
    rounds = 0
    if policy == "fixed":
        samples.extend(await sample(m, 0))
        rounds = 1
    elif policy == "adaptive":
        budget = m
        while True:
            values = [s.value for s in samples]
            if is_decided(values, budget, min_valid):
                break
            k = next_round_size(values, budget, min_valid)
            if k == 0:  # budget spent and still split: escalate, or stop at m_max
                if budget >= m_max:
                    break
                budget = min(m_max, budget + max(1, escalate_step))
                continue
            samples.extend(await sample(k, rounds))
            rounds += 1
    elif policy == "sequential" and stop_rule == "error_budget":
        if tracker is None:
            raise ValueError("stop_rule 'error_budget' needs an AgreementTracker")
        first = min(max(m, 2), max(first_round, min_valid, 2))  # two votes at least: the tracker's pair
        samples.extend(await sample(first, 0))
        rounds = 1
        agreement, unparseable, concentration = tracker.estimate()
        table = stop_table(
            agreement,
            unparseable,
            len(outcomes),
            m,
            max(m, m_max, first),
            first,
            min_valid,
            error_budget_share,
            concentration,
        )
        while state_of([s.value for s in samples], outcomes) not in table:
            samples.extend(await sample(1, rounds))
            rounds += 1
        tracker.observe([s.value for s in samples])
    elif policy == "sequential":
        budget = m
        k = min(budget, max(first_round, min_valid, 1))
        while True:
            if k:
                samples.extend(await sample(k, rounds))
                rounds += 1
            values = [s.value for s in samples]
            remaining = budget - len(values)
            settled = majority_vote(values).status == STATUS_OK and sum(v is not None for v in values) >= min_valid
            if settled and (
                remaining <= 0 or change_probability(values, remaining, outcomes, stop_prior) < stop_change_prob
            ):
                break
            if remaining <= 0:  # budget spent and still split (or too few parseable votes): escalate
                if budget >= m_max:
                    break
                budget = min(m_max, budget + max(1, escalate_step))
            k = 1
    else:
        raise ValueError(f"unknown voting policy {policy!r}")
    result = majority_vote([s.value for s in samples])
    n_valid = sum(s.value is not None for s in samples)
    if result.status == STATUS_OK and n_valid < min_valid:
        result = VoteResult(
            score=0,
            status=STATUS_NO_VALID,
            votes=result.votes,
            confidence=result.confidence,
            reason=f"only {n_valid} parseable vote(s), need {min_valid}",
        )
    result.rounds = rounds
    result.samples = list(samples)
    return result


def select_hint(
    samples: Sequence[Vote], result: VoteResult, *, min_chars: int = 10, require_majority: bool = False
) -> str | None:
    """Longest hint of a +1 vote longer than ``min_chars`` (first wins a length tie), or None."""
    if require_majority and not (result.status == STATUS_OK and result.score == 1):
        return None
    best: str | None = None
    for s in samples:
        if s.value != 1 or not s.hint:
            continue
        hint = s.hint.strip()
        if len(hint) > min_chars and (best is None or len(hint) > len(best)):
            best = hint
    return best
