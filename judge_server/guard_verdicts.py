"""How the deterministic guards' hits shape a judged step's verdicts (the judge service's side of
judge_server.guards; docs/CONTRACTS.md "Judge service").

Role: pure functions the JudgeService applies after the votes of each task, whatever the backend. The
decisive hit (:func:`judge_server.guards.decisive`, the strongest action) rules the PRM verdict:

- ``override``: ``score: -1``, status ``ok``, confidence 1.0 (a rule, not a vote share), reason
  ``guard <rule>: <detail>``; the votes stay for audit.
- ``abstain``: ``score: null``, status ``abstained``, confidence 0.0, the same reason.
- ``quarantine``: ``score: null``, status ``quarantined``, confidence 0.0, the same reason.

Every PRM verdict lists the hits (``guards``, in rule order; empty when none fired). A hint verdict is changed
only by a quarantine (a degenerate reply's hint is never accepted): ``accepted: false``, ``hint: null``, status
``quarantined``, ``vote_status`` still the votes' own outcome.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.records import (
    STATUS_ABSTAINED,
    STATUS_OK,
    STATUS_QUARANTINED,
    GuardHit,
    HintVerdict,
    JudgeUsage,
    PrmVerdict,
    VerdictStatus,
)
from judge_server.guards import GuardedStep, decisive
from judge_server.schemas import JudgeRequest

# The PRM outcome of each action: (score, status, confidence).
_PRM_OUTCOME: dict[str, tuple[int | None, VerdictStatus, float]] = {
    "override": (-1, STATUS_OK, 1.0),
    "abstain": (None, STATUS_ABSTAINED, 0.0),
    "quarantine": (None, STATUS_QUARANTINED, 0.0),
}


def step_of(req: JudgeRequest) -> GuardedStep:
    """The judged step as the guards read it: the request's messages as plain dicts (``finish_reason`` included)."""
    return GuardedStep(
        context=[m.model_dump(exclude_none=True) for m in req.context],
        response=req.response.model_dump(exclude_none=True),
        next_state=[m.model_dump(exclude_none=True) for m in req.next_state],
        tools=req.tools,
    )


def guard_reason(hit: GuardHit) -> str:
    return f"guard {hit.rule}: {hit.detail}"


def _usage(verdict: JudgeUsage) -> JudgeUsage:
    return JudgeUsage(**{name: getattr(verdict, name) for name in JudgeUsage.model_fields})


def guarded_prm(verdict: PrmVerdict, hits: Sequence[GuardHit]) -> PrmVerdict:
    """``verdict`` with the hits recorded and, when one fired, its decisive action applied."""
    score, status, confidence, reason = verdict.score, verdict.status, verdict.confidence, verdict.reason
    hit = decisive(hits)
    if hit is not None:
        score, status, confidence = _PRM_OUTCOME[hit.action]
        reason = guard_reason(hit)
    return PrmVerdict.wire(
        score=score if score is None else int(score),
        status=status,
        votes=list(verdict.votes),
        confidence=confidence,
        reason=reason,
        usage=_usage(verdict),
        guards=list(hits),
    )


def guarded_hint(verdict: HintVerdict, hits: Sequence[GuardHit]) -> HintVerdict:
    """``verdict``, or, when a quarantine fired, the same votes with no hint accepted (status quarantined)."""
    hit = decisive(hits)
    if hit is None or hit.action != "quarantine":
        return verdict
    return HintVerdict.wire(
        accepted=False,
        hint=None,
        votes=list(verdict.votes),
        status=STATUS_QUARANTINED,
        reason=guard_reason(hit),
        vote_status=verdict.vote_status or STATUS_OK,
        usage=_usage(verdict),
    )
