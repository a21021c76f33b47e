"""Group semantics of PRM-scored exports, and the two grouped rollout filters.

``ReadyTrajectories``: an in-process ledger of ready session trajectories. ``consume(session_id)`` hands a
trajectory out exactly once; a second consume raises ``PRMTrajectoryUnavailable`` (already consumed), so a
retried export never rescores it (and, as in AReaL, a lost answer is not replayed).

``await score_group(runner, ready, session_ids, discard=False, is_eval=False) -> GroupResult``:
- ``discard=True`` consumes the sessions and skips scoring entirely (``accepted=False``, reason ``discarded``);
- otherwise every requested session is consumed and the present ones are scored concurrently (each session's
  branches in order). A missing, already-consumed or failed session rejects the WHOLE group (no partial
  acceptance); every session that did score still publishes its observations; failed ones publish none.
  Cancellation propagates.

Filters over one complete group of sample dicts (sample JSON of docs/CONTRACTS.md: ``reward``,
``token_rewards``, ``loss_mask``, ``response_ids``) return True to keep the group:
- ``filter_mixed_or_penalized_all_wrong``: keep groups with mixed outcome rewards, and all-wrong groups
  (every reward <= 0) in which some active token (loss_mask 1) has a negative process reward;
- ``filter_mixed_or_penalized_all_wrong_mask_no_eos``: the same, but penalties on truncated samples (last
  response id not an EOS id, or ``truncated: true``) do not count, because the actor masks those samples.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prm.cache import TurnCache
from prm.errors import PRMError, PRMTrajectoryUnavailable
from prm.export import SessionScore, score_branches
from prm.runner import PRMRunner


class ReadyTrajectories:
    """Ready trajectories by session id; each one can be consumed once."""

    def __init__(self) -> None:
        self._ready: dict[str, TurnCache] = {}
        self._consumed: set[str] = set()

    def put(self, session_id: str, turns: Sequence[Mapping[str, Any]]) -> None:
        if session_id in self._consumed:
            raise PRMTrajectoryUnavailable(f"session {session_id!r} was already consumed")
        self._ready[session_id] = TurnCache.from_turns(turns)

    def consume(self, session_id: str) -> TurnCache:
        if session_id in self._consumed:
            raise PRMTrajectoryUnavailable(f"session {session_id!r} was already consumed; it is not rescored")
        cache = self._ready.pop(session_id, None)
        if cache is None:
            raise PRMTrajectoryUnavailable(f"session {session_id!r} has no ready trajectory")
        self._consumed.add(session_id)
        return cache

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._ready


@dataclass(frozen=True)
class GroupResult:
    accepted: bool
    reason: str | None = None
    scored: Mapping[str, SessionScore] = field(default_factory=dict)
    failures: Mapping[str, str] = field(default_factory=dict)


async def score_group(
    runner: PRMRunner,
    ready: ReadyTrajectories,
    session_ids: Sequence[str],
    *,
    discard: bool = False,
    is_eval: bool = False,
) -> GroupResult:
    """Consume and score one requested group (see module docstring)."""
    caches: dict[str, TurnCache] = {}
    failures: dict[str, str] = {}
    for sid in session_ids:
        try:
            caches[sid] = ready.consume(sid)
        except PRMTrajectoryUnavailable as exc:
            failures[sid] = str(exc)
    if discard:
        for _ in caches:
            runner.metrics.count_session(is_eval=is_eval, outcome="discarded")
        return GroupResult(False, "discarded", failures=failures)

    async def one(sid: str, cache: TurnCache) -> SessionScore | PRMError:
        try:
            return await score_branches(runner, cache, is_eval=is_eval)
        except PRMError as exc:
            return exc

    outcomes = await asyncio.gather(*(one(sid, c) for sid, c in caches.items()))
    scored: dict[str, SessionScore] = {}
    for sid, outcome in zip(caches, outcomes, strict=True):
        if isinstance(outcome, PRMError):
            failures[sid] = f"scoring failed: {outcome}"
        else:
            scored[sid] = outcome
    if failures:
        first = next(iter(failures))
        return GroupResult(False, f"group rejected: session {first!r}: {failures[first]}", scored, failures)
    return GroupResult(True, None, scored, failures)


def _rewards(group: Sequence[Mapping[str, Any]]) -> list[float]:
    if not group:
        raise ValueError("group filtering needs at least one sample")
    out = []
    for s in group:
        r = s.get("reward")
        if r is None or isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise ValueError(f"group filtering needs a finite outcome reward on every sample, got {r!r}")
        out.append(float(r))
    return out


def _truncated(sample: Mapping[str, Any], eos_token_ids: Collection[int]) -> bool:
    if "truncated" in sample:
        return bool(sample["truncated"])
    ids = sample.get("response_ids") or []
    return not ids or ids[-1] not in eos_token_ids


def _has_penalty(sample: Mapping[str, Any]) -> bool:
    rewards, mask = sample.get("token_rewards"), sample.get("loss_mask")
    if rewards is None or mask is None:
        return False
    if len(rewards) != len(mask):
        raise ValueError(f"token_rewards ({len(rewards)}) and loss_mask ({len(mask)}) lengths differ")
    if not all(math.isfinite(float(r)) for r in rewards):
        raise ValueError("token_rewards must be finite")
    return any(float(r) < 0 and m for r, m in zip(rewards, mask, strict=True))


def _keep(group: Sequence[Mapping[str, Any]], eos_token_ids: Collection[int] | None) -> bool:
    rewards = _rewards(group)
    if any(r != rewards[0] for r in rewards):
        return True
    if not all(r <= 0 for r in rewards):
        return False
    samples = group if eos_token_ids is None else [s for s in group if not _truncated(s, eos_token_ids)]
    return any(_has_penalty(s) for s in samples)


def filter_mixed_or_penalized_all_wrong(group: Sequence[Mapping[str, Any]]) -> bool:
    """Keep mixed-outcome groups and all-wrong groups that still carry a negative process reward."""
    return _keep(group, None)


def filter_mixed_or_penalized_all_wrong_mask_no_eos(
    group: Sequence[Mapping[str, Any]], eos_token_ids: Collection[int]
) -> bool:
    """As above, ignoring penalties on truncated (no-EOS) samples, which the actor masks."""
    return _keep(group, eos_token_ids)
