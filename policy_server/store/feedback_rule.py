"""Explicit feedback (``POST /v1/feedback``) as a reward signal: how it combines with the judge's verdict.

Role: the pure decision the store applies when feedback reaches a judged sample (policy_server.store.feedback),
and the dispatcher applies when a turn with feedback is judged (policy_server.rewards.dispatch): one rule below
both, so the store imports nothing of the reward layer. docs/REWARD_MODES.md ("Explicit feedback") is the
user-facing contract.

- Value: ``up`` = +1, ``down`` = -1, or a number in [-1, 1] (policy_server.rewards.feedback.feedback_value).
  A turn's feedback value is its latest distinct feedback (a user who changes their mind is heard; a retried
  request with the same idempotency key counts once).
- The judge's reward ``j`` is read from the sample's stored ``prm`` verdict (never from its current reward,
  so re-applying is idempotent): +-1 or 0 for an ``ok`` verdict, 0 for a ``tie``, none otherwise.
- ``--feedback-policy`` (:data:`FEEDBACK_POLICIES`):

  - ``override``: reward = feedback; the verdict is kept for audit only.
  - ``average``: reward = (j + feedback) / 2, or the feedback alone when the judge gave no verdict.
  - ``gate``: the judge's +-1 is kept only when the feedback has the same sign; otherwise the turn is
    excluded ``feedback_gate: ...`` (feedback alone never makes a reward under this policy).

  A resulting reward of 0 excludes the turn ``feedback_neutral`` (no direction to learn), unless a teacher
  term keeps it (combine).
- Modes: rl and combine use the reward; opd has no reward term, so feedback there changes nothing but is
  recorded (its text may serve as the hint, see policy_server.rewards.modes). Only samples whose exclusion
  concerns the reward signal (:data:`REDECIDABLE`) can be re-included; a turn refused for its own defects
  (history mismatch, empty reply, teacher mismatch, ...) stays refused.
- At-least-one after feedback: feedback that excludes a session's last included sample re-runs the rule
  (the store does, in the same transaction): the session's earliest turn the rule would have promoted when
  it was judged (:func:`promotable`: a neutral PRM verdict, rl or combine) is included with reward 0.0
  (:func:`promote`). A turn the rule already promoted stays included when feedback later includes another.
- Agreement: the judge's verdict sign (:func:`judge_sign`, none without a PRM verdict) against the feedback
  value's sign (:func:`value_sign`); equal signs agree, neutral against neutral included.
"""

from __future__ import annotations

from typing import Literal, get_args

from engine.records import STATUS_OK, STATUS_TIE, SampleJSON
from engine.records import RejectReason as R
from engine.records import SampleState as S

FeedbackPolicy = Literal["override", "average", "gate"]
FEEDBACK_POLICIES: tuple[str, ...] = get_args(FeedbackPolicy)
# Rejections about the reward signal only: the turn itself is trainable, feedback may supply the signal.
REDECIDABLE: tuple[str, ...] = (
    R.NO_NEXT_STATE,
    R.PRM_NEUTRAL,
    R.PRM_TIE,
    R.PRM_NO_VALID_VOTES,
    R.JUDGE_FAILED,
    R.NO_SIGNAL,
    R.FEEDBACK_NEUTRAL,
    R.FEEDBACK_GATE,
)
# Rejections the at-least-one rule includes at judging time (modes.decide) when their PRM verdict is neutral.
PROMOTABLE: tuple[str, ...] = (R.PRM_NEUTRAL, R.PRM_TIE, R.NO_SIGNAL)


def judge_reward(prm: object) -> float | None:
    """The reward the judge's stored PRM verdict gives: its score when ``ok``, 0 for a ``tie``, else None."""
    if not isinstance(prm, dict):
        return None
    score = prm.get("score")
    if prm.get("status") == STATUS_OK and isinstance(score, int | float) and not isinstance(score, bool):
        return float(score)
    if prm.get("status") == STATUS_TIE:
        return 0.0
    return None


def value_sign(value: float) -> int:
    """+1, -1 or 0: the direction of a feedback value or a judge reward."""
    return (value > 0) - (value < 0)


def judge_sign(prm: object) -> int | None:
    """The sign of the judge's stored PRM verdict (0 for a neutral or tied one), None without a verdict
    (opd, judge_failed, no_valid_votes): such a turn makes no agreement pair."""
    judge = judge_reward(prm)
    return None if judge is None else value_sign(judge)


def combined_reward(policy: str, judge: float | None, value: float) -> tuple[float | None, str | None]:
    """(reward, None) or (None, why excluded) for a judge reward and a feedback value under ``policy``."""
    if policy == "override":
        reward: float | None = value
    elif policy == "average":
        reward = value if judge is None else (judge + value) / 2
    elif policy == "gate":
        if judge is None or judge == 0 or judge * value <= 0:
            shown = "none" if judge is None else f"{judge:+g}"
            return None, R.with_detail(R.FEEDBACK_GATE, f"judge {shown}, feedback {value:+g}")
        reward = judge
    else:
        raise ValueError(f"feedback policy must be one of {', '.join(FEEDBACK_POLICIES)}, not {policy!r}")
    if reward == 0:
        return None, R.FEEDBACK_NEUTRAL
    return reward, None


def applicable(status: str, reject_reason: str | None) -> bool:
    """Whether feedback can still change a sample in this state (not leased or consumed, not refused for
    a defect of the turn itself)."""
    if status in (S.READY, S.PENDING_SCORE):
        return True
    if status == S.REJECTED and reject_reason:
        return reject_reason.split(":", 1)[0] in REDECIDABLE
    return False


def apply_feedback(
    status: str,
    reject_reason: str | None,
    sample: SampleJSON,
    *,
    value: float,
    text: str | None,
    policy: str,
    count: int = 1,
) -> tuple[str, str | None, SampleJSON]:
    """The sample's (status, reject_reason, JSON) once ``value`` is combined with its judge verdict.

    ``status`` must be :func:`applicable`; ``pending_score`` stays held when the turn stays included. The
    returned JSON carries ``feedback`` {value, text, policy, judge_reward, count}."""
    out = dict(sample)
    judge = judge_reward(out.get("prm"))
    out["feedback"] = {"value": value, "text": text, "policy": policy, "judge_reward": judge, "count": count}
    mode = out.get("mode")
    if mode not in ("rl", "combine"):
        return status, reject_reason, out  # no reward term in this mode: recorded only
    reward, why = combined_reward(policy, judge, value)
    n = len(out.get("response_ids") or out.get("loss_mask") or [])
    has_teacher = bool(out.get("has_teacher"))
    out.update(reward=reward, has_reward=reward is not None)
    include = reward is not None or has_teacher
    out["loss_mask"] = [1 if include else 0] * n
    if not include:
        return S.REJECTED, why, out
    if status == S.PENDING_SCORE:
        return status, None, out
    return S.READY, None, out


def promotable(reject_reason: str | None, sample: SampleJSON) -> bool:
    """Whether the at-least-one rule may include this rejected sample: the rule's own case at judging time
    (modes.decide), a neutral or tied PRM verdict in rl or combine (``prm_neutral``, ``prm_tie``, or
    ``no_signal`` over a neutral verdict). Never a turn refused for its own defects, a ``no_valid_votes``
    or failed verdict, or one whose reward feedback already decided (``feedback_*``)."""
    if not reject_reason or sample.get("mode") not in ("rl", "combine"):
        return False
    return reject_reason.split(":", 1)[0] in PROMOTABLE and judge_reward(sample.get("prm")) == 0.0


def promote(sample: SampleJSON) -> SampleJSON:
    """A :func:`promotable` sample as the at-least-one rule includes it: reward 0.0 on every response token
    (with A = r it adds no gradient; with a baseline it is a below-average example)."""
    out = dict(sample)
    n = len(out.get("response_ids") or out.get("loss_mask") or [])
    out.update(reward=0.0, has_reward=True, loss_mask=[1] * n)
    return out
