"""Majority voting over judge samples: the fixed (prior-system) rule, the adaptive policy, hint selection.

Contract (issue 3, openclaw-rl-notes §5.3, §7.2, §15.1-3):
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
- ``select_hint``: the prior rule (longest hint of a +1 vote, stripped, longer than ``min_chars``);
  with ``require_majority`` a hint is only taken when the vote result is ``ok`` with score 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

STATUS_OK = "ok"
STATUS_TIE = "tie"
STATUS_NO_VALID = "no_valid_votes"
STATUS_FAILED = "judge_failed"


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
        return VoteResult(score=0, status=STATUS_NO_VALID, votes=list(votes), confidence=0.0,
                          reason="no parseable vote")
    ranked = Counter(valid).most_common()
    top_value, top_count = ranked[0]
    confidence = top_count / len(valid)
    if len(ranked) > 1 and ranked[1][1] == top_count:
        return VoteResult(score=0, status=STATUS_TIE, votes=list(votes), confidence=confidence,
                          reason="tie between the top verdicts")
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


Sampler = Callable[[int, int], Awaitable[list[Vote]]]


async def run_policy(
    sample: Sampler,
    *,
    policy: str,
    m: int,
    m_max: int,
    min_valid: int = 1,
    escalate_step: int = 2,
    collected: list[Vote] | None = None,
) -> VoteResult:
    """Draw votes per ``policy`` and aggregate them. ``collected`` receives samples as they arrive, so a
    caller still sees the votes of finished rounds when a later round raises."""
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
    else:
        raise ValueError(f"unknown voting policy {policy!r}")
    result = majority_vote([s.value for s in samples])
    n_valid = sum(s.value is not None for s in samples)
    if result.status == STATUS_OK and n_valid < min_valid:
        result = VoteResult(score=0, status=STATUS_NO_VALID, votes=result.votes, confidence=result.confidence,
                            reason=f"only {n_valid} parseable vote(s), need {min_valid}")
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
