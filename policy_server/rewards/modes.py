"""Reward modes rl / opd / combine: one judge call per turn, then one sample per turn.

Role: the policy server's dispatcher hands every recorded turn (with its next state, or None for a
session's last turn) to :meth:`RewardPipeline.process`, which asks the judge service for the verdicts
the current mode needs, scores the teacher when a hint was accepted, and returns the reward-mode fields
of the :class:`~engine.records.Sample` and its status: an :class:`~engine.records.PipelineOutcome`.
Semantics (docs/REWARD_MODES.md):

- mode is read from :class:`ModeState` at process() time (switchable at runtime via /admin/mode);
  each sample records the mode and the (w_rl, w_opd) in force when its turn was judged.
- judge tasks: rl -> ["prm"], opd -> ["hint"], combine -> ["prm", "hint"] in ONE call (the judge
  service runs both concurrently).
- rl: PRM +-1 -> ready, loss_mask all 1, reward = score. Neutral (score 0 or ``tie``) -> rejected,
  unless the at-least-one guarantee promotes it (reward 0.0, loss_mask all 1). ``no_valid_votes`` ->
  rejected, never promoted (there is no verdict to train on); so is ``abstained`` (a judge guard withheld
  the score: ``prm_abstained: <rule>``).
- Guards (the judge's deterministic rules, judge_server.guards): in every mode a verdict whose ``guards``
  hold a quarantine hit (or a task verdict ``quarantined``) rejects the turn ``degenerate: <rule>: <detail>``,
  before anything else is decided: never promoted by at-least-one, never re-included by explicit feedback.
- A turn carrying ``feedback_hint`` (the text of explicit feedback, set by the dispatcher when
  ``--feedback-hint`` is on) uses it as the accepted hint instead of asking the judge for one.
- opd: accepted hint -> teacher log-probs on the hint-augmented prompt (policy_server.rewards.teacher);
  reward absent (has_reward false); no accepted hint -> rejected ``no_hint``.
- combine: has_reward iff PRM gave +-1; has_teacher iff a hint was accepted and scored; neither ->
  rejected ``no_signal`` unless at-least-one promotes a neutral PRM verdict. The teacher term is never
  faked with the rollout log-probs.
- A task with status ``judge_failed`` (the judge's engines failed within its deadline), a 4xx from the
  judge, or a teacher answer that does not line up with the response ids rejects the turn with the
  reason (stored, never silently included, never turned into a 0 score). An unreachable judge service
  or teacher engine is NOT a verdict: ``JudgeUnavailable`` / ``EngineUnavailable`` / ``EngineTimeout``
  propagate out of process() and the dispatcher keeps the turn ``pending_judge`` and retries it later.
  No next state -> rejected ``no_next_state`` in every mode (there is no evidence to judge).

At-least-one: a turn that would be excluded ONLY for being neutral is included when the session has no
included sample yet (``session_has_included`` is the dispatcher's count, in judging-completion order).
With a pure reward advantage (A = r) its reward 0.0 contributes zero gradient; it changes learning
only when the trainer uses a baseline (A = r - b). See docs/REWARD_MODES.md.

Collaborators are typed by what the pipeline uses (:class:`Judge`, :class:`TeacherEngine`,
:class:`RewardSettings`): the policy server passes its JudgeClient, EngineClient and PolicySettings, tests
may pass any object with those members. Statuses and reject reasons come from engine.records; the pure
per-turn decision (:func:`decide` and its classifiers) lives in policy_server.rewards.decisions.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol, cast

from engine.records import (
    MODES,
    STATUS_OK,
    HintVerdict,
    JudgeUsage,
    JudgeVerdicts,
    Mode,
    ModeSnapshot,
    PipelineOutcome,
    PipelineTurn,
    PrmVerdict,
    Sample,
    TeacherTopK,
)
from engine.records import RejectReason as R
from engine.validation import clip
from judge_server.errors import JudgeBadResponse, JudgeRequestRejected
from policy_server.rewards.decisions import (
    Decision,
    InvalidMode,
    accepted_hint_text,
    classify_hint,
    classify_prm,
    decide,
    quarantine_reason,
)
from policy_server.rewards.teacher import TeacherEngine, TeacherFailed, TeacherScorer

logger = logging.getLogger(__name__)

__all__ = [
    "MODES",
    "TASKS_BY_MODE",
    "Decision",
    "InvalidMode",
    "Judge",
    "ModeSnapshot",
    "ModeState",
    "RewardPipeline",
    "RewardSettings",
    "TeacherEngine",
    "accepted_hint_text",
    "build_sample",
    "classify_hint",
    "classify_prm",
    "decide",
    "quarantine_reason",
]
TASKS_BY_MODE: dict[str, list[str]] = {"rl": ["prm"], "opd": ["hint"], "combine": ["prm", "hint"]}


class Judge(Protocol):
    """The judge service as the pipeline calls it (judge_server.client.JudgeClient): the /v1/judge verdicts."""

    async def judge(
        self,
        context: list[dict[str, object]],
        response: dict[str, object],
        next_state: list[dict[str, object]],
        tasks: list[str],
        m: int | None = None,
        *,
        tools: list[dict[str, object]] | None = None,
    ) -> JudgeVerdicts: ...


class RewardSettings(Protocol):
    """The settings the reward pipeline reads (policy_server.settings.PolicySettings; defaults live there)."""

    @property
    def mode(self) -> str: ...
    @property
    def w_rl(self) -> float: ...
    @property
    def w_opd(self) -> float: ...
    @property
    def judge_m(self) -> int | None: ...
    @property
    def at_least_one(self) -> bool: ...
    @property
    def teacher_top_k(self) -> int: ...
    @property
    def teacher_temperature(self) -> float: ...
    @property
    def teacher_max_concurrency(self) -> int: ...
    @property
    def teacher_deadline_s(self) -> float | None: ...


def _check_weight(name: str, value: float) -> float:
    try:
        w = float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidMode(f"{name} must be a number, got {clip(value)}") from exc
    if not math.isfinite(w) or w < 0:
        raise InvalidMode(f"{name} must be finite and >= 0, got {clip(value)}")
    return w


class ModeState:
    """Mutable holder of (mode, w_rl, w_opd), shared by the pipeline and GET|POST /admin/mode.

    Assignment swaps one immutable snapshot, so a concurrent reader never sees a half-applied change.
    """

    def __init__(self, mode: str = "rl", w_rl: float = 1.0, w_opd: float = 1.0):
        self._snap = self._validate(mode, w_rl, w_opd)

    @staticmethod
    def _validate(mode: str, w_rl: float, w_opd: float) -> ModeSnapshot:
        if mode not in MODES:
            raise InvalidMode(f"mode must be one of {', '.join(MODES)}, got {clip(mode)}")
        # the membership test above is the narrowing mypy cannot see
        return ModeSnapshot(
            mode=cast(Mode, mode), w_rl=_check_weight("w_rl", w_rl), w_opd=_check_weight("w_opd", w_opd)
        )

    @classmethod
    def from_settings(cls, settings: RewardSettings) -> ModeState:
        return cls(settings.mode, settings.w_rl, settings.w_opd)

    def set(self, mode: str | None = None, w_rl: float | None = None, w_opd: float | None = None) -> ModeSnapshot:
        """Validate and apply; a None argument keeps its current value. Raises InvalidMode."""
        cur = self._snap
        self._snap = self._validate(
            cur.mode if mode is None else mode,
            cur.w_rl if w_rl is None else w_rl,
            cur.w_opd if w_opd is None else w_opd,
        )
        logger.info("reward mode set to %s (w_rl=%s, w_opd=%s)", self._snap.mode, self._snap.w_rl, self._snap.w_opd)
        return self._snap

    def snapshot(self) -> ModeSnapshot:
        return self._snap

    @property
    def mode(self) -> str:
        return self._snap.mode

    @property
    def w_rl(self) -> float:
        return self._snap.w_rl

    @property
    def w_opd(self) -> float:
        return self._snap.w_opd


def build_sample(
    snap: ModeSnapshot,
    n_response: int,
    *,
    include: bool,
    prm: PrmVerdict | None,
    hint: HintVerdict | None,
    reward: float | None,
    teacher_logprobs: list[float] | None,
    teacher_topk: TeacherTopK | None,
    prompt_versions: dict[str, str] | None = None,
    teacher_temperature: float | None = None,
) -> Sample:
    """The reward pipeline's fields of one :class:`~engine.records.Sample` (``mode`` .. ``w_opd``, then
    ``prompt_versions`` when given); loss_mask has one entry per response id.

    The judge/teacher template versions travel with the sample so every stored verdict can be traced to
    the exact prompt text that produced it.
    """
    sample = Sample(
        mode=snap.mode,
        loss_mask=[1 if include else 0] * n_response,
        reward=reward,
        has_reward=reward is not None,
        has_teacher=teacher_logprobs is not None,
        prm=prm,
        hint=hint,
        teacher_logprobs=teacher_logprobs,
        teacher_topk=teacher_topk,
        token_rewards=None,
        w_rl=snap.w_rl,
        w_opd=snap.w_opd,
    )
    if teacher_logprobs is not None and teacher_temperature is not None:
        sample.teacher_temperature = teacher_temperature  # recorded with the log-probs it produced
    if prompt_versions is not None:
        sample.prompt_versions = dict(prompt_versions)
    return sample


def feedback_hint_verdict(text: str) -> HintVerdict:
    """A user's typed correction as an accepted hint verdict (``source: feedback``, no judge cost)."""
    verdict = HintVerdict.wire(
        accepted=True,
        hint=text.strip(),
        votes=[],
        status=STATUS_OK,
        reason=None,
        vote_status=STATUS_OK,
        usage=JudgeUsage(),
    )
    # An extra field (the schema keeps unknown keys) after the wire fields, where the stored JSON has it.
    return HintVerdict.model_validate({**verdict.to_json(), "source": "feedback"})


# ---------------------------------------------------------------------------- pipeline
class RewardPipeline:
    """Judge -> (teacher) -> sample for one turn. One instance per policy server, shared by all sessions."""

    def __init__(
        self,
        *,
        judge: Judge,
        teacher: TeacherEngine | None,
        tokenizer: Any,
        settings: RewardSettings,
        mode_state: ModeState | None = None,
    ) -> None:
        self.judge = judge
        self.settings = settings
        self.mode_state = mode_state or ModeState.from_settings(settings)
        self.judge_m = settings.judge_m
        self.at_least_one = settings.at_least_one
        self.teacher: TeacherScorer | None = None
        if teacher is not None:
            self.teacher = TeacherScorer(
                teacher,
                tokenizer,
                top_k=settings.teacher_top_k,
                temperature=settings.teacher_temperature,
                max_concurrency=settings.teacher_max_concurrency,
                deadline_s=settings.teacher_deadline_s,
            )

    async def process(
        self,
        turn: PipelineTurn,
        next_state: list[dict[str, object]] | None,
        *,
        session_has_included: bool,
        session_done: bool,
    ) -> PipelineOutcome:
        """Judge one turn under the current mode and return its outcome (status + sample fields).

        Raises JudgeUnavailable (judge service unreachable after its retries) and EngineUnavailable /
        EngineTimeout (teacher engine unreachable): the turn was not judged and must be retried later.

        ``session_done`` only marks the call as the session's final flush; a turn without a next state
        is rejected ``no_next_state`` whether or not the session is done.
        """
        snap = self.mode_state.snapshot()
        n = len(turn.response_ids)
        versions: dict[str, str] = {}

        def reject(reason: str, prm: PrmVerdict | None = None, hint: HintVerdict | None = None) -> PipelineOutcome:
            sample = build_sample(
                snap,
                n,
                include=False,
                prm=prm,
                hint=hint,
                reward=None,
                teacher_logprobs=None,
                teacher_topk=None,
                prompt_versions=versions,
            )
            return PipelineOutcome.rejected(reason, sample, versions)

        if n == 0:
            return reject(R.EMPTY_RESPONSE)
        tasks = TASKS_BY_MODE[snap.mode]
        # A correction the user typed (explicit feedback text, put here by the dispatcher) is the hint: no
        # judge call is spent extracting one, and it needs no next state.
        feedback_hint = turn.feedback_hint
        if feedback_hint is not None and feedback_hint.strip() and "hint" in tasks:
            tasks = [t for t in tasks if t != "hint"]
        else:
            feedback_hint = None
        if not next_state and tasks:
            return reject(R.NO_NEXT_STATE)
        if (feedback_hint or "hint" in tasks) and self.teacher is None:
            # Judging a hint we cannot use would spend judge calls for nothing; say why instead.
            return reject(f"{R.NO_TEACHER}: no teacher engine is configured for opd/combine")
        verdict = JudgeVerdicts()
        if tasks:
            try:
                verdict = await self.judge.judge(
                    turn.messages, turn.response, next_state or [], tasks, m=self.judge_m, tools=turn.tools
                )
            except JudgeRequestRejected as exc:  # the judge refused this input (4xx): retrying cannot help
                return reject(f"{R.JUDGE_REJECTED}: {exc.message}")
            except JudgeBadResponse as exc:  # an answer off the verdict schema is a failed judgement, never a score
                return reject(f"{R.JUDGE_FAILED}: {exc.message}")
        versions.update(verdict.prompt_versions)
        prm, hint = verdict.prm, verdict.hint
        if feedback_hint is not None:
            hint = feedback_hint_verdict(feedback_hint)
            versions["hint"] = "feedback"
        decision = decide(
            snap.mode,
            prm,
            hint,
            session_has_included=session_has_included,
            at_least_one=self.at_least_one,
            guards=verdict.guards,
        )
        if not decision.include:
            return reject(decision.reason or R.EXCLUDED, prm, hint)

        # a neutral verdict promoted by at-least-one trains with reward 0.0 (a tie has no score)
        reward = float(prm.score or 0) if decision.use_reward and prm is not None else None
        teacher_logprobs: list[float] | None = None
        teacher_topk: TeacherTopK | None = None
        if decision.need_teacher:
            assert self.teacher is not None  # checked before the judge call
            hint_text = None if hint is None else accepted_hint_text(hint)
            assert hint_text is not None  # decide() asks for the teacher only with an accepted hint
            versions["teacher_hint"] = self.teacher.template.version
            try:
                scores = await self.teacher.score_turn(turn, hint_text)
            except TeacherFailed as exc:
                logger.warning("teacher failed for %s/%s: %s", turn.session_id, turn.turn_index, exc)
                return reject(str(exc), prm, hint)
            teacher_logprobs, teacher_topk = scores.logprobs, scores.topk
        if decision.promoted:
            logger.info("at-least-one: promoting neutral turn %s/%s", turn.session_id, turn.turn_index)
        sample = build_sample(
            snap,
            n,
            include=True,
            prm=prm,
            hint=hint,
            reward=reward,
            teacher_logprobs=teacher_logprobs,
            teacher_topk=teacher_topk,
            prompt_versions=versions,
            teacher_temperature=self.teacher.temperature if self.teacher is not None else None,
        )
        return PipelineOutcome.ready(sample, versions)
