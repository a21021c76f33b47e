"""The error-budget stopping rule of the ``sequential`` voting policy, and the online vote-noise estimate it uses.

Role: decide, after each vote, whether a judge turn may stop, so that the turn's expected error is no worse than
that of fixed m-vote majority voting, at the fewest expected votes.

Contract:
- Vote model (one-coin with a rival): a turn's true verdict t is uniform over the K ``outcomes`` and so is its
  rival r among the others; each vote is unparseable with probability ``unparseable``, else t with
  probability ``agreement`` (a), else r with probability (1-a) * ``concentration`` (c), else one of the other
  K-2 verdicts uniformly. c = 1/(K-1) is the symmetric model (wrong votes uniform); K=2 has c = 1.
  The posterior over (t, r) given the counts is exact (uniform prior over the K * (K-1) pairs).
- A turn is an error unless it ends with a strict plurality (status ``ok``, at least ``min_valid`` parseable
  votes) on the true verdict. :func:`fixed_error` is that error after m votes (fixed m-vote voting).
- :func:`stop_table` is the Bayes-optimal stopping rule for "error + cost_per_vote * votes" over the count
  states reachable within ``m_max`` votes (the first ``first_round`` votes always drawn), with the largest
  cost_per_vote (found by bisection) whose expected error is at most ``error_budget_share * fixed_error``.
  It returns the set of count states (sorted parseable counts, unparseable count) at which to stop; every
  state at ``m_max`` votes is in it. Cached per model (the estimate is on a grid).
- :class:`AgreementTracker` estimates (a, unparseable, c) per judge-service instance and task from finished
  turns, over a bounded window of the last ``window_turns`` turns (running sums, O(1) per turn), blended with
  a warm-up default (a = ``default_agreement``, symmetric c) worth ``prior_turns`` turns. It reads only votes
  whose drawing did not depend on the votes' values: the first two of a turn (always drawn), and the third
  after two parseable disagreeing votes (a tie never stops a turn, so it is always drawn when m_max > 2);
  early stopping does not bias it. Two parseable votes agree with probability r = a**2 + g * (1-a)**2, g =
  P(two wrong votes agree); the tracker inverts that for a. c stays symmetric unless the share of third
  votes that differ from both disagreeing votes is over two standard errors below the symmetric model's
  prediction; then c is the grid value (step 0.05, up to 0.95) whose model matches it. Safe to call from
  threads and tasks (one lock).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations_with_replacement

State = tuple[tuple[int, ...], int]  # (parseable counts sorted descending, K entries; unparseable count)


def _pair_same_wrong(concentration: float, k: int) -> float:
    """P(two wrong votes of one turn agree): the rival twice, or the same one of the K-2 others."""
    return 1.0 if k == 2 else concentration**2 + (1 - concentration) ** 2 / (k - 2)


def agreement_from_pair_rate(pair_agree_rate: float, k_outcomes: int, concentration: float | None = None) -> float:
    """Invert r = a**2 + g * (1-a)**2 (g: :func:`_pair_same_wrong`) for a >= the root at chance (clamped to 1)."""
    g = _pair_same_wrong(1 / (k_outcomes - 1) if concentration is None else concentration, k_outcomes)
    disc = g * g - (1 + g) * (g - pair_agree_rate)
    return min(1.0, (g + math.sqrt(max(0.0, disc))) / (1 + g))


def _hypotheses(k: int) -> list[tuple[int, int]]:
    return [(t, r) for t in range(k) for r in range(k) if r != t]


def _vote_probs(t: int, r: int, agreement: float, concentration: float, k: int) -> list[float]:
    other = 0.0 if k == 2 else (1 - agreement) * (1 - concentration) / (k - 2)
    return [agreement if j == t else (1 - agreement) * concentration if j == r else other for j in range(k)]


def _posterior(counts: Sequence[int], agreement: float, concentration: float, k: int) -> dict[tuple[int, int], float]:
    """P((truth slot, rival slot) | counts), uniform prior over the K * (K-1) pairs."""
    logs: dict[tuple[int, int], float] = {}
    for t, r in _hypotheses(k):
        probs = _vote_probs(t, r, agreement, concentration, k)
        if any(c and p == 0 for c, p in zip(counts, probs, strict=True)):
            continue
        logs[(t, r)] = sum(c * math.log(p) for c, p in zip(counts, probs, strict=True) if c)
    top = max(logs.values())
    w = {h: math.exp(v - top) for h, v in logs.items()}
    total = sum(w.values())
    return {h: x / total for h, x in w.items()}


def _stop_error(counts: tuple[int, ...], min_valid: int, agreement: float, concentration: float, k: int) -> float:
    """P(error) if the turn stops at these sorted counts: 1 without a strict leader or enough parseable votes."""
    if sum(counts) < min_valid or counts[0] == 0 or counts[1] == counts[0]:
        return 1.0
    return 1.0 - sum(p for (t, _), p in _posterior(counts, agreement, concentration, k).items() if t == 0)


def _next_vote(
    counts: tuple[int, ...], agreement: float, concentration: float, unparseable: float, k: int
) -> list[float]:
    """Predictive probability that the next vote is parseable and goes to each sorted-count slot."""
    out = [0.0] * k
    for (t, r), p in _posterior(counts, agreement, concentration, k).items():
        for j, pj in enumerate(_vote_probs(t, r, agreement, concentration, k)):
            out[j] += (1 - unparseable) * p * pj
    return out


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


def _solve(
    cost_per_vote: float,
    agreement: float,
    unparseable: float,
    k: int,
    first_round: int,
    m_max: int,
    min_valid: int,
    concentration: float,
) -> tuple[frozenset[State], float]:
    """Stop set and expected error (from the empty state) of the optimal rule at ``cost_per_vote``."""
    value: dict[State, float] = {}
    error: dict[State, float] = {}
    stop: set[State] = set()
    for n in range(m_max, -1, -1):
        for state in _states(n, k):
            stop_err = _stop_error(state[0], min_valid, agreement, concentration, k)
            if n == m_max:
                value[state], error[state] = stop_err, stop_err
                stop.add(state)
                continue
            probs = _next_vote(state[0], agreement, concentration, unparseable, k)
            nxt = [(p, _step(state, j)) for j, p in enumerate(probs)] + [(unparseable, _step(state, -1))]
            go_value = cost_per_vote + sum(p * value[s] for p, s in nxt)
            go_error = sum(p * error[s] for p, s in nxt)
            if n >= first_round and stop_err <= go_value:
                value[state], error[state] = stop_err, stop_err
                stop.add(state)
            else:
                value[state], error[state] = go_value, go_error
    return frozenset(stop), error[((0,) * k, 0)]


def fixed_error(
    agreement: float, unparseable: float, k: int, m: int, min_valid: int, concentration: float | None = None
) -> float:
    """Expected error of fixed m-vote majority voting under the vote model."""
    conc = 1.0 if k == 2 else 1 / (k - 1) if concentration is None else concentration
    never_stop = _solve(0.0, agreement, unparseable, k, first_round=m, m_max=m, min_valid=min_valid, concentration=conc)
    return never_stop[1]


@lru_cache(maxsize=512)
def stop_table(
    agreement: float,
    unparseable: float,
    k: int,
    m: int,
    m_max: int,
    first_round: int,
    min_valid: int,
    error_budget_share: float,
    concentration: float | None = None,
) -> frozenset[State]:
    """The cheapest rule with expected error <= ``error_budget_share`` * the fixed m-vote error (module doc)."""
    conc = 1.0 if k == 2 else 1 / (k - 1) if concentration is None else concentration
    target = error_budget_share * fixed_error(agreement, unparseable, k, m, min_valid, conc)
    lo, hi = 0.0, 1.0  # cost per vote: 0 never stops before m_max; 1 stops as soon as allowed
    best = _solve(lo, agreement, unparseable, k, first_round, m_max, min_valid, conc)[0]
    for _ in range(40):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 1024
        table, err = _solve(mid, agreement, unparseable, k, first_round, m_max, min_valid, conc)
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


def distinct_third_rate(agreement: float, concentration: float, k: int) -> float:
    """P(a third parseable vote differs from both of two disagreeing parseable votes) under the vote model."""
    p = _vote_probs(0, 1, agreement, concentration, k)
    s2, s3 = sum(x * x for x in p), sum(x**3 for x in p)
    return (1 - 3 * s2 + 2 * s3) / (1 - s2) if s2 < 1 else 0.0


class AgreementTracker:
    """Online estimate of the vote model for one task of one judge-service instance (module doc)."""

    def __init__(
        self,
        k_outcomes: int,
        *,
        default_agreement: float,
        default_unparseable: float,
        prior_turns: int,
        window_turns: int,
    ) -> None:
        self.k = k_outcomes
        self.default_agreement = default_agreement
        self.default_unparseable = default_unparseable
        self.prior_turns = prior_turns
        # one entry per turn: (parseable votes among the first two, 1 if those agree, third vote after a parseable
        # disagreeing pair: 1 a third verdict, 0 one of the two, -1 none or unparseable)
        self._turns: deque[tuple[int, int, int]] = deque(maxlen=window_turns)
        # running sums over the window: turns, parseable first-pair votes, parseable pairs, agreeing pairs,
        # third votes seen after a disagreeing pair, third verdicts among them
        self._sums = [0, 0, 0, 0, 0, 0]
        self._lock = threading.Lock()

    @staticmethod
    def _terms(entry: tuple[int, int, int]) -> tuple[int, ...]:
        parseable, agree, third = entry
        return 1, parseable, int(parseable == 2), agree, int(third >= 0), max(third, 0)

    def observe(self, votes: Sequence[int | None]) -> None:
        """Record a finished turn's votes in draw order (only the first three are read); under two are ignored."""
        if len(votes) < 2:
            return
        a, b = votes[0], votes[1]
        parseable = (a is not None) + (b is not None)
        third = -1
        if parseable == 2 and a != b and len(votes) > 2 and votes[2] is not None:
            third = int(votes[2] not in (a, b))
        entry = (parseable, int(parseable == 2 and a == b), third)
        with self._lock:
            if len(self._turns) == self._turns.maxlen:
                self._sums = [x - y for x, y in zip(self._sums, self._terms(self._turns[0]), strict=True)]
            self._turns.append(entry)
            self._sums = [x + y for x, y in zip(self._sums, self._terms(entry), strict=True)]

    def estimate(self) -> tuple[float, float, float]:
        """(agreement, unparseable, concentration) on grids of 0.01, 0.01 and 0.05, so stop tables are cached."""
        with self._lock:
            n_turns, parseable, both, agree, n_thirds, distinct = self._sums
        k, w = self.k, self.prior_turns
        uniform = 1 / (k - 1)
        a0 = self.default_agreement
        prior_rate = a0**2 + _pair_same_wrong(uniform, k) * (1 - a0) ** 2
        pair_rate = (agree + w * prior_rate) / (both + w)
        unparseable = (2 * n_turns - parseable + w * 2 * self.default_unparseable) / (2 * n_turns + 2 * w)
        concentration = 1.0 if k == 2 else uniform
        if k > 2:
            w_third = w * (1 - prior_rate)  # the warm-up's share of disagreeing pairs
            third_rate = (distinct + w_third * distinct_third_rate(a0, uniform, k)) / (n_thirds + w_third)
            # concentrated wrong votes rarely produce a third verdict. Keep the symmetric model unless the
            # distinct-third rate is more than two standard errors below its prediction (noise alone would
            # flip the stop table back and forth); then take the concentration (from uniform up to 0.95)
            # whose model, fitted to the pair rate, best matches it.
            d_uniform = distinct_third_rate(agreement_from_pair_rate(pair_rate, k, uniform), uniform, k)
            std_err = math.sqrt(d_uniform * (1 - d_uniform) / (n_thirds + w_third))
            if third_rate < d_uniform - 3 * std_err:
                grid = [uniform + i * 0.05 for i in range(round((0.95 - uniform) / 0.05) + 1)]
                concentration = min(
                    grid,
                    key=lambda c: abs(
                        distinct_third_rate(agreement_from_pair_rate(pair_rate, k, c), c, k) - third_rate
                    ),
                )
        agreement = agreement_from_pair_rate(pair_rate, k, concentration)
        # keep the model proper: strictly between chance and certainty, and some parseable votes
        agreement = min(0.99, max(1 / k + 0.01, round(agreement, 2)))
        return agreement, min(0.9, round(unparseable, 2)), round(concentration, 2)
