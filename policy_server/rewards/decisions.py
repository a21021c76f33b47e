"""The reward modes' pure decision: what one judged turn becomes, from the judge's verdicts and guard hits.

Role: the table of docs/REWARD_MODES.md as functions, no I/O (policy_server.rewards.modes runs them for each
turn and re-exports them). :func:`decide` takes the mode, the ``prm`` / ``hint`` verdicts, the answer's guard
hits and the session's at-least-one state, and returns a :class:`Decision`:

- a guard's quarantine (a hit with action ``quarantine``, or a verdict ``quarantined``) rejects the turn
  ``degenerate: <rule>: <detail>`` in every mode, before anything else: never promoted, never trained;
- rl: PRM +-1 is a signal; neutral (0, ``tie``) is rejected unless at-least-one promotes it; ``no_valid_votes``
  and ``abstained`` (``prm_abstained: <rule>``) have no verdict and are never promoted; ``judge_failed`` rejects;
- opd: an accepted hint asks for the teacher, else ``no_hint``;
- combine: either signal suffices; a failed task rejects; neither -> ``no_signal`` unless at-least-one promotes
  a neutral PRM verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.records import (
    STATUS_ABSTAINED,
    STATUS_FAILED,
    STATUS_NO_VALID,
    STATUS_QUARANTINED,
    STATUS_TIE,
    GuardHit,
    HintVerdict,
    PrmVerdict,
)
from engine.records import RejectReason as R
from engine.validation import clip


class InvalidMode(ValueError):
    """A mode or weight the admin endpoint must answer with 400."""


# PRM outcome kinds: "signal" (+-1), "neutral" (score 0 or tie), "no_verdict" (no_valid_votes, abstained),
# "quarantined", "failed". Hint outcome kinds: "accepted", "none", "quarantined", "failed".


def _first_hit(hits: Sequence[GuardHit], action: str) -> GuardHit | None:
    return next((h for h in hits if h.action == action), None)


def quarantine_reason(prm: PrmVerdict | None, hint: HintVerdict | None, hits: Sequence[GuardHit] = ()) -> str | None:
    """``degenerate: <rule>: <detail>`` when a judge guard quarantined the step (its first quarantine hit, from
    the answer's ``guards`` or the PRM verdict's; else a verdict's status), or None."""
    hit = _first_hit(hits, "quarantine") or (None if prm is None else _first_hit(prm.guards, "quarantine"))
    if hit is not None:
        return R.with_detail(R.DEGENERATE, f"{hit.rule}: {hit.detail}")
    for verdict in (prm, hint):
        if verdict is not None and verdict.status == STATUS_QUARANTINED:
            # The judge's reason is "guard <rule>: <detail>": the rule leads, as with a hit.
            return R.with_detail(R.DEGENERATE, (verdict.reason or "quarantined by the judge").removeprefix("guard "))
    return None


def classify_prm(prm: PrmVerdict | None) -> tuple[str, str]:
    """(kind, reason-if-not-signal) of the judge's ``prm`` verdict (None: the judge's answer lacked it)."""
    if prm is None:
        return "failed", f"{R.JUDGE_FAILED}: prm: verdict missing from judge response"
    status, score = prm.status, prm.score
    if status == STATUS_FAILED:
        return "failed", f"{R.JUDGE_FAILED}: prm: {prm.reason or 'no reason given'}"
    if status == STATUS_NO_VALID:
        return "no_verdict", R.PRM_NO_VALID_VOTES
    if status == STATUS_ABSTAINED:
        hit = _first_hit(prm.guards, "abstain")
        return "no_verdict", R.PRM_ABSTAINED if hit is None else R.with_detail(R.PRM_ABSTAINED, hit.rule)
    if status == STATUS_QUARANTINED:
        return "quarantined", quarantine_reason(prm, None) or R.DEGENERATE
    if status == STATUS_TIE:
        return "neutral", R.PRM_TIE
    if score in (1, -1):
        return "signal", ""
    if score == 0:
        return "neutral", R.PRM_NEUTRAL
    return "failed", f"{R.JUDGE_FAILED}: prm: unexpected verdict status={status!r} score={score!r}"


def classify_hint(hint: HintVerdict | None) -> tuple[str, str]:
    """(kind, reason-if-not-accepted) of the judge's ``hint`` verdict (None: the judge's answer lacked it)."""
    if hint is None:
        return "failed", f"{R.JUDGE_FAILED}: hint: verdict missing from judge response"
    if hint.status == STATUS_FAILED:
        return "failed", f"{R.JUDGE_FAILED}: hint: {hint.reason or 'no reason given'}"
    if hint.status == STATUS_QUARANTINED:
        return "quarantined", quarantine_reason(None, hint) or R.DEGENERATE
    if hint.accepted and accepted_hint_text(hint):
        return "accepted", ""
    return "none", R.NO_HINT


def accepted_hint_text(hint: HintVerdict) -> str | None:
    """The hint's text when it is one the teacher can use (non-blank), else None."""
    return hint.hint if hint.hint is not None and hint.hint.strip() else None


@dataclass(frozen=True)
class Decision:
    """What to build for one judged turn, before any teacher call."""

    include: bool
    reason: str | None
    use_reward: bool  # sample carries reward = PRM score
    need_teacher: bool  # score the teacher with the accepted hint
    promoted: bool = False  # included by the at-least-one guarantee


def decide(
    mode: str,
    prm: PrmVerdict | None,
    hint: HintVerdict | None,
    *,
    session_has_included: bool,
    at_least_one: bool,
    guards: Sequence[GuardHit] = (),
) -> Decision:
    """Pure per-mode decision from the judge verdicts and guard hits (see module docstring for the table)."""
    degenerate = quarantine_reason(prm, hint, guards)
    if degenerate is not None:  # whatever the mode and the votes: a degenerate reply is never trained
        return Decision(False, degenerate, use_reward=False, need_teacher=False)
    promote_ok = at_least_one and not session_has_included
    if mode == "rl":
        kind, why = classify_prm(prm)
        if kind == "signal":
            return Decision(True, None, use_reward=True, need_teacher=False)
        if kind == "neutral" and promote_ok:
            return Decision(True, None, use_reward=True, need_teacher=False, promoted=True)
        return Decision(False, why, use_reward=False, need_teacher=False)
    if mode == "opd":
        kind, why = classify_hint(hint)
        if kind == "accepted":
            return Decision(True, None, use_reward=False, need_teacher=True)
        return Decision(False, why, use_reward=False, need_teacher=False)
    if mode == "combine":
        p_kind, p_why = classify_prm(prm)
        h_kind, h_why = classify_hint(hint)
        # A failed task means we do not know the turn's signal: reject rather than train half of it.
        failures = [w for k, w in ((p_kind, p_why), (h_kind, h_why)) if k == "failed"]
        if failures:
            return Decision(False, "; ".join(failures), use_reward=False, need_teacher=False)
        has_reward, has_teacher = p_kind == "signal", h_kind == "accepted"
        if has_reward or has_teacher:
            return Decision(True, None, use_reward=has_reward, need_teacher=has_teacher)
        if p_kind == "neutral" and promote_ok:
            return Decision(True, None, use_reward=True, need_teacher=False, promoted=True)
        return Decision(False, f"{R.NO_SIGNAL}: {p_why}, {R.NO_HINT}", use_reward=False, need_teacher=False)
    raise InvalidMode(f"unknown mode {clip(mode)}")
