"""The error-budget stopping rule of the ``sequential`` voting policy, and the online vote-noise estimate it uses.

Role: decide, after each vote, whether a judge turn may stop, so that the turn's expected error is no worse than
that of fixed m-vote majority voting, at the fewest expected votes.

Contract:
- Vote model (one-coin, symmetric): a turn's true verdict is uniform over the K ``outcomes``; each vote is
  unparseable with probability ``unparseable``, else the truth with probability ``agreement``, else one of
  the other K-1 verdicts uniformly. Given the counts so far, P(verdict t is true) is proportional to
  (agreement * (K-1) / (1 - agreement)) ** count_t.
- A turn is an error unless it ends with a strict plurality (status ``ok``, at least ``min_valid`` parseable
  votes) on the true verdict. The fixed rule's expected error ``fixed_error`` is that error after m votes.
- :func:`stop_table` is the Bayes-optimal stopping rule for "error + cost_per_vote * votes" over the count
  states reachable within ``m_max`` votes (the first ``first_round`` votes always drawn), with the largest
  cost_per_vote (found by bisection) whose expected error is at most ``error_budget_share * fixed_error``.
  It returns the set of count states (sorted parseable counts, unparseable count) at which to stop.
- :class:`AgreementTracker` keeps, per judge-service instance and task, the estimate of ``agreement`` and
  ``unparseable``: from the first round's first two votes only (always drawn before any stopping decision, so
  early stopping does not bias it), over a bounded window of the last ``window_turns`` turns, blended with
  a warm-up default worth ``prior_turns`` turns. Two parseable votes agree with probability
  r = a**2 + (1-a)**2 / (K-1); the tracker inverts that. Safe to call from threads and tasks (one lock).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations_with_replacement

State = tuple[tuple[int, ...], int]  # (parseable counts sorted descending, K entries; unparseable count)


def agreement_from_pair_rate(pair_agree_rate: float, k_outcomes: int) -> float:
    """Invert r = a**2 + (1-a)**2 / (K-1) for a >= 1/K (clamped to [1/K, 1])."""
    k = k_outcomes
    disc = 1 - k * (1 - (k - 1) * pair_agree_rate)
    return min(1.0, (1 + math.sqrt(max(0.0, disc))) / k)


def _posterior(counts: Sequence[int], agreement: float, k: int) -> list[float]:
    log_ratio = math.log(agreement * (k - 1) / (1 - agreement))
    top = max(counts)
    w = [math.exp((c - top) * log_ratio) for c in counts]
    total = sum(w)
    return [x / total for x in w]


def _stop_error(counts: tuple[int, ...], min_valid: int, agreement: float, k: int) -> float:
    """P(error) if the turn stops at these sorted counts: 1 without a strict leader or enough parseable votes."""
    if sum(counts) < min_valid or counts[0] == 0 or (k > 1 and counts[1] == counts[0]):
        return 1.0
    return 1.0 - _posterior(counts, agreement, k)[0]


def _next_vote(counts: tuple[int, ...], agreement: float, unparseable: float, k: int) -> list[float]:
    """Predictive probability that the next parseable vote goes to each sorted-count slot, times (1 - unparseable)."""
    post = _posterior(counts, agreement, k)
    wrong = (1 - agreement) / (k - 1)
    return [(1 - unparseable) * (post[j] * agreement + (1 - post[j]) * wrong) for j in range(k)]


def _step(state: State, slot: int) -> State:
    counts, invalid = state
    if slot < 0:
        return counts, invalid + 1
    bumped = list(counts)
    bumped[slot] += 1
    return tuple(sorted(bumped, reverse=True)), invalid


def _states(n_votes: int, k: int) -> list[State]:
    out: list[State] = []
    for invalid in range(n_votes + 1):
        for combo in combinations_with_replacement(range(k), n_votes - invalid):
            counts = [0] * k
            for c in combo:
                counts[c] += 1
            out.append((tuple(sorted(counts, reverse=True)), invalid))
    return sorted(set(out))


def _solve(cost_per_vote: float, agreement: float, unparseable: float, k: int, first_round: int, m_max: int,
           min_valid: int) -> tuple[frozenset[State], float]:
    """Stop set and expected error (from the empty state) of the optimal rule at ``cost_per_vote``."""
    value: dict[State, float] = {}
    error: dict[State, float] = {}
    stop: set[State] = set()
    for n in range(m_max, -1, -1):
        for state in _states(n, k):
            stop_err = _stop_error(state[0], min_valid, agreement, k)
            if n == m_max:
                value[state], error[state] = stop_err, stop_err
                stop.add(state)
                continue
            probs = _next_vote(state[0], agreement, unparseable, k)
            nxt = [(p, _step(state, j)) for j, p in enumerate(probs)] + [(unparseable, _step(state, -1))]
            go_value = cost_per_vote + sum(p * value[s] for p, s in nxt)
            go_error = sum(p * error[s] for p, s in nxt)
            if n >= first_round and stop_err <= go_value:
                value[state], error[state] = stop_err, stop_err
                stop.add(state)
            else:
                value[state], error[state] = go_value, go_error
    return frozenset(stop), error[((0,) * k, 0)]


def fixed_error(agreement: float, unparseable: float, k: int, m: int, min_valid: int) -> float:
    """Expected error of fixed m-vote majority voting under the vote model."""
    never_stop = _solve(0.0, agreement, unparseable, k, first_round=m, m_max=m, min_valid=min_valid)
    return never_stop[1]


@lru_cache(maxsize=512)
def stop_table(agreement: float, unparseable: float, k: int, m: int, m_max: int, first_round: int,
               min_valid: int, error_budget_share: float) -> frozenset[State]:
    """The cheapest rule with expected error <= ``error_budget_share`` * the fixed m-vote error (module doc)."""
    target = error_budget_share * fixed_error(agreement, unparseable, k, m, min_valid)
    lo, hi = 0.0, 1.0  # cost per vote: 0 never stops before m_max; 1 stops as soon as allowed
    best = _solve(lo, agreement, unparseable, k, first_round, m_max, min_valid)[0]
    for _ in range(40):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 1024
        table, err = _solve(mid, agreement, unparseable, k, first_round, m_max, min_valid)
        if err <= target:
            lo, best = mid, table
        else:
            hi = mid
        if lo > 0 and hi / lo < 1.01:
            break
    return best


def state_of(votes: Sequence[int | None], outcomes: Sequence[int]) -> State:
    counts = tuple(sorted((sum(v == o for v in votes) for o in outcomes), reverse=True))
    return counts, sum(v is None for v in votes)


class AgreementTracker:
    """Online estimate of (agreement, unparseable) for one task of one judge-service instance (module doc)."""

    def __init__(self, k_outcomes: int, *, default_agreement: float, default_unparseable: float,
                 prior_turns: int, window_turns: int) -> None:
        self.k = k_outcomes
        self.default_agreement = default_agreement
        self.default_unparseable = default_unparseable
        self.prior_turns = prior_turns
        self._pairs: deque[tuple[int, int]] = deque(maxlen=window_turns)  # (parseable votes, agreeing pair)
        self._lock = threading.Lock()

    def observe(self, first_votes: Sequence[int | None]) -> None:
        """Record a turn's first two votes (drawn before any stopping decision); fewer are ignored."""
        if len(first_votes) < 2:
            return
        a, b = first_votes[0], first_votes[1]
        parseable = (a is not None) + (b is not None)
        with self._lock:
            self._pairs.append((parseable, int(a is not None and a == b)))

    def estimate(self) -> tuple[float, float]:
        """(agreement, unparseable) rounded to a grid of 0.01, so the stop tables are cached."""
        with self._lock:
            turns = len(self._pairs)
            parseable = sum(p for p, _ in self._pairs)
            both = sum(p == 2 for p, _ in self._pairs)
            agree = sum(a for _, a in self._pairs)
        w = self.prior_turns
        k = self.k
        prior_rate = self.default_agreement ** 2 + (1 - self.default_agreement) ** 2 / (k - 1)
        pair_rate = (agree + w * prior_rate) / (both + w)
        unparseable = (2 * turns - parseable + w * 2 * self.default_unparseable) / (2 * turns + 2 * w)
        agreement = agreement_from_pair_rate(pair_rate, k)
        # keep the model proper: strictly between chance and certainty, and some parseable votes
        agreement = min(0.99, max(1 / k + 0.01, round(agreement, 2)))
        return agreement, min(0.9, round(unparseable, 2))
