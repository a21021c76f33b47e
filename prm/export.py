"""Branch-isolated scoring of one session, and ``score_session``: the policy server's entry point.

``await score_session(runner, turns, is_eval=False) -> dict[int, list[float]]``
    ``turns``: the session's token-backed turn dicts (shape in ``prm.cache``). Returns
    ``turn_index -> token_rewards`` with ``len(token_rewards) == len(response_ids)`` (generated tokens only;
    prompt tokens carry no process reward), each the weighted sum of all enabled scorers. ``{}`` when the
    runner has no active scorer (store ``token_rewards: null``). Raises ``PRMInputError`` for turns that are
    not scorable and ``PRMRejected`` when any scorer rejects any branch: then the session's samples must be
    rejected (never stored as reward 0). ``PRMRunnerClosed`` once the runner is closing.

Branches: every root-to-leaf path is scored on its own clone (``TurnCache.clone_chain``), in leaf order, so a
shared ancestor gets a branch-local score and the session's cache is never modified. ``score_branches``
returns every branch; ``score_session`` reports a turn shared by several branches with the score from the
first branch (lowest leaf) that contains it. Metrics (turn rewards, per-branch totals, observations) are
recorded on ``runner.metrics`` only after every branch succeeded; a failed session publishes nothing but a
``rejected`` session count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prm.cache import TurnCache
from prm.errors import PRMError, PRMRunnerClosed
from prm.metrics import PRMStats, build_stats
from prm.runner import PRMRunner, branch_messages
from prm.types import PRMTurnResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BranchScore:
    """One scored root-to-leaf branch."""

    leaf_id: str
    turn_indices: tuple[int, ...]
    token_rewards: Mapping[int, list[float]]
    turn_results: tuple[PRMTurnResult, ...]
    totals: Mapping[str, float]  # scorer -> sum over the branch's turns of the weighted turn reward


@dataclass(frozen=True)
class SessionScore:
    """All branches of one session, plus the stats it published (``prm_stats``)."""

    session_id: str
    branches: tuple[BranchScore, ...] = ()
    stats: PRMStats = field(default_factory=PRMStats)

    def token_rewards_by_turn(self) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for branch in self.branches:
            for turn_index, rewards in branch.token_rewards.items():
                out.setdefault(turn_index, rewards)
        return dict(sorted(out.items()))


async def score_branches(
    runner: PRMRunner,
    cache: TurnCache,
    ctx: Mapping[str, Any] | None = None,
    *,
    is_eval: bool = False,
    record_metrics: bool = True,
) -> SessionScore:
    """Score each branch of ``cache`` on a clone; publish metrics only if all branches succeed."""
    if runner.closing:
        raise PRMRunnerClosed("PRMRunner is closing; no new scoring is admitted")
    items = cache.items()
    session_id = items[0][1].session_id if items else ""
    if not runner.active or not items:
        return SessionScore(session_id)
    branches: list[BranchScore] = []
    try:
        for leaf_id in cache.leaf_ids():
            clone = cache.clone_chain(leaf_id)
            ordered = clone.ordered()
            branch_ctx = {
                **(ctx or {}),
                "messages": branch_messages(ordered),
                "session_id": session_id,
                "leaf_id": leaf_id,
            }
            results = await runner.run(clone, branch_ctx, is_eval=is_eval, record_metrics=False)
            rewards: dict[int, list[float]] = {}
            for it in ordered:
                tokens = clone.token_rewards(it.interaction_id)
                if tokens is not None:
                    rewards[it.turn_index] = [float(v) for v in tokens.tolist()]
            totals: dict[str, float] = {}
            for res in results:
                totals[res.scorer_name] = totals.get(res.scorer_name, 0.0) + res.reward
            branches.append(
                BranchScore(leaf_id, tuple(it.turn_index for it in ordered), rewards, tuple(results), totals)
            )
    except PRMError as exc:
        if record_metrics:
            runner.metrics.count_session(is_eval=is_eval, outcome="rejected")
        logger.warning("PRM rejected session %s: %s", session_id, exc)
        raise
    stats = build_stats([r for b in branches for r in b.turn_results], [b.totals for b in branches], is_eval=is_eval)
    if record_metrics:
        runner.metrics.record(stats)
        runner.metrics.count_session(is_eval=is_eval, outcome="scored")
    return SessionScore(session_id, tuple(branches), stats)


async def score_session(
    runner: PRMRunner, turns: Sequence[Mapping[str, Any]], *, is_eval: bool = False
) -> dict[int, list[float]]:
    """The policy server's hook: ``turn_index -> token_rewards`` for a session whose turns are ready."""
    if not runner.active:
        return {}
    cache = TurnCache.from_turns(turns)
    return (await score_branches(runner, cache, is_eval=is_eval)).token_rewards_by_turn()
