"""The schema of record: every datum that crosses a service boundary or lives in the sample store.

Role: ONE definition of the recorded turn, the judge's verdicts and the training sample, imported by the
policy server (recording, reward modes, dispatch, store), the judge service and its client, the trainer
and the benches. docs/CONTRACTS.md describes each shape and points here.

- :class:`TurnRecord` is what the policy server records for a main turn (the store's ``turns.record``
  JSON); :class:`Turn` adds the store's columns (session, index, pairing, next state).
- :class:`PrmVerdict` / :class:`HintVerdict` are the judge's per-task answers (``POST /v1/judge``), with
  their cost fields (:class:`JudgeUsage`); :class:`JudgeVerdicts` is the whole answer.
- :class:`Sample` is the Sample JSON the trainer leases (``GET /v1/samples/lease``).

Wire contract: ``record.to_json()`` (``model_dump(mode="json", exclude_unset=True)``) reproduces the JSON
the services exchange, key for key and in the same order: fields are declared in the order the producers
write them, a key the producer did not write stays absent (a rejected sample built before its verdicts
carries only what it got), a ``None`` it wrote stays ``null``, and unknown keys
are kept (``extra="allow"``: a newer producer's field survives an older reader). Values are not coerced
(``strict``), except an int where a float is declared; a non-finite float stays a float (``NaN``), so the
value checks of :func:`Sample.value_problem` see exactly what the producer wrote.

Statuses and reject reasons are defined here once; every module that writes or compares one imports it.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from engine.sample_values import value_problem

# ---------------------------------------------------------------------------- statuses and reasons
Mode = Literal["rl", "opd", "combine"]
MODES: tuple[str, ...] = get_args(Mode)

# A judge task's outcome. ``ok``: a verdict; ``tie`` / ``no_valid_votes``: votes that settle nothing;
# ``judge_failed``: the judge's engines failed within its deadline (never a score); ``abstained``: a guard
# withheld the score (no score); ``quarantined``: a guard found the reply degenerate (no score, never trained).
VerdictStatus = Literal["ok", "tie", "no_valid_votes", "judge_failed", "abstained", "quarantined"]
STATUS_OK: VerdictStatus = "ok"
STATUS_TIE: VerdictStatus = "tie"
STATUS_NO_VALID: VerdictStatus = "no_valid_votes"
STATUS_FAILED: VerdictStatus = "judge_failed"
STATUS_ABSTAINED: VerdictStatus = "abstained"
STATUS_QUARANTINED: VerdictStatus = "quarantined"
VERDICT_STATUSES: tuple[str, ...] = get_args(VerdictStatus)

# A stored sample's state: pending_judge -> [pending_score ->] ready -> leased -> consumed, or rejected.
SampleStatus = Literal["pending_judge", "pending_score", "ready", "leased", "consumed", "rejected"]
SAMPLE_STATUSES: tuple[str, ...] = get_args(SampleStatus)


class SampleState:
    """The :data:`SampleStatus` values by name (the store's ``samples.status`` column)."""

    PENDING_JUDGE: SampleStatus = "pending_judge"
    PENDING_SCORE: SampleStatus = "pending_score"  # accepted, held until its session is scored
    READY: SampleStatus = "ready"
    LEASED: SampleStatus = "leased"
    CONSUMED: SampleStatus = "consumed"
    REJECTED: SampleStatus = "rejected"


# What judging may decide, and what scoring a held sample may decide.
JUDGE_OUTCOME_STATUSES: tuple[SampleStatus, ...] = (SampleState.READY, SampleState.REJECTED, SampleState.PENDING_SCORE)
SCORE_OUTCOME_STATUSES: tuple[SampleStatus, ...] = (SampleState.READY, SampleState.REJECTED)
# Accepted and not consumed yet: the trainer's backlog.
UNCONSUMED_STATUSES: tuple[SampleStatus, ...] = (
    SampleState.PENDING_JUDGE,
    SampleState.PENDING_SCORE,
    SampleState.READY,
    SampleState.LEASED,
)


class RejectReason:
    """``reject_reason`` values of a rejected sample: exact strings, and prefixes followed by the detail."""

    EMPTY_RESPONSE = "empty_response"
    NO_NEXT_STATE = "no_next_state"
    NO_HINT = "no_hint"
    PRM_TIE = "prm_tie"
    PRM_NEUTRAL = "prm_neutral"
    PRM_NO_VALID_VOTES = "prm_no_valid_votes"
    CLIENT_DISCONNECTED = "client_disconnected"
    HISTORY_MISMATCH = "history_mismatch"
    CONCURRENT_TURNS = "concurrent_turns"
    EXCLUDED = "excluded"
    # prefixes: "<prefix>: <why>"
    JUDGE_FAILED = "judge_failed"
    JUDGE_REJECTED = "judge_rejected"
    JUDGE_UNAVAILABLE = "judge_unavailable"
    NO_TEACHER = "no_teacher"
    NO_SIGNAL = "no_signal"
    PIPELINE_ERROR = "pipeline_error"
    PRM_REJECTED = "prm_rejected"
    INVALID_VALUES = "invalid_values"
    FEEDBACK_NEUTRAL = "feedback_neutral"  # explicit feedback made the reward 0
    FEEDBACK_GATE = "feedback_gate"  # explicit feedback disagreed with the judge under the gate policy
    PRM_ABSTAINED = "prm_abstained"  # a guard withheld the PRM score: "prm_abstained: <rule>"
    DEGENERATE = "degenerate"  # a guard quarantined the reply: "degenerate: <rule>: <detail>"
    SECRET = "secret"  # the turn held a secret, redacted in the store: "secret: <kinds>"

    @staticmethod
    def with_detail(prefix: str, detail: str) -> str:
        return f"{prefix}: {detail}"


class _Record(BaseModel):
    """Shared wire behaviour (see the module docstring)."""

    model_config = ConfigDict(extra="allow", strict=True, ser_json_inf_nan="constants")

    def to_json(self, *, share: tuple[str, ...] = ()) -> dict[str, Any]:
        """The record as the JSON object it travels as (absent keys stay absent).

        ``share``: list fields whose values are JSON already (parsed from JSON, token ids) and go into the
        result as they are, the same list objects, instead of being dumped item by item (a 30k-token turn's
        messages and prompt ids); the result then shares them with the record, and neither may change them."""
        if not share:
            return self.model_dump(mode="json", exclude_unset=True)
        shared = {k: getattr(self, k) for k in share if k in self.model_fields_set}
        # Dumped with empty stand-ins, then the values put back: the keys keep the field order.
        out = self.model_copy(update=dict.fromkeys(shared, [])).model_dump(mode="json", exclude_unset=True)
        out.update(shared)
        return out


class Interval(BaseModel):
    """A closed interval ``[lo, hi]`` of a real quantity: the canary test's confidence sequences
    (engine.sequential, answered by ``GET /admin/weights``) and the judge evaluation's bootstrap intervals."""

    model_config = ConfigDict(frozen=True, strict=True)

    lo: float
    hi: float


class ModeSnapshot(BaseModel):
    """The reward mode and combine weights in force (policy_server.rewards.modes.ModeState): read once per judged
    turn, persisted as the ``mode`` runtime setting and answered by ``/admin/mode``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode
    w_rl: float
    w_opd: float


# ---------------------------------------------------------------------------- judge verdicts
class JudgeUsage(_Record):
    """The judge's cost of one task (or, as ``usage``, of the whole request)."""

    engine_calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


GuardAction = Literal["override", "abstain", "quarantine"]


class GuardHit(_Record):
    """One deterministic guard that fired on a judged step (judge_server.guards): the rule's name, the
    action it took on the PRM verdict, and what it saw."""

    rule: str
    action: GuardAction
    detail: str


class _PrmVotes(_Record):
    score: int | float | None = None
    status: VerdictStatus = STATUS_OK
    votes: list[int | None] = []
    confidence: float = 0.0
    reason: str | None = None
    guards: list[GuardHit] = []  # the enabled guards that fired on the step (absent in older records)


class PrmVerdict(JudgeUsage, _PrmVotes):
    """The ``prm`` task: the step's score (+1 / -1 / 0) by majority vote, null when ``judge_failed``,
    ``abstained`` or ``quarantined``; the guard hits behind a ruled outcome; then its cost (the vote fields
    come first on the wire, hence the base order)."""

    @classmethod
    def wire(
        cls,
        *,
        score: int | None,
        status: str,
        votes: list[int | None],
        confidence: float,
        reason: str | None,
        usage: JudgeUsage,
        guards: list[GuardHit] | None = None,
    ) -> PrmVerdict:
        """A verdict in the judge's key order: the vote fields, the guard hits, then the cost fields."""
        return cls.model_validate(
            {
                "score": score,
                "status": status,
                "votes": votes,
                "confidence": confidence,
                "reason": reason,
                "guards": [g.to_json() for g in guards or []],
                **usage.model_dump(),
            }
        )


class _HintVotes(_Record):
    accepted: bool = False
    hint: str | None = None
    votes: list[int | None] = []
    # ``quarantined``: a guard found the reply degenerate, so no hint is accepted whatever the votes said.
    status: Literal["ok", "judge_failed", "quarantined"] = "ok"
    reason: str | None = None
    vote_status: VerdictStatus | None = None  # the vote rule's own outcome behind ``status``


class HintVerdict(JudgeUsage, _HintVotes):
    """The ``hint`` task: the hindsight hint the votes accepted (``status`` ok), or none; then its cost."""

    @classmethod
    def wire(
        cls,
        *,
        accepted: bool,
        hint: str | None,
        votes: list[int | None],
        status: str,
        reason: str | None,
        vote_status: str,
        usage: JudgeUsage,
    ) -> HintVerdict:
        """A verdict in the judge's key order: the vote fields, then the cost fields."""
        return cls.model_validate(
            {
                "accepted": accepted,
                "hint": hint,
                "votes": votes,
                "status": status,
                "reason": reason,
                "vote_status": vote_status,
                **usage.model_dump(),
            }
        )


class JudgeVerdicts(_Record):
    """``POST /v1/judge``'s answer: a verdict per requested task, every enabled guard that fired on the step
    (in rule order, whatever tasks were asked), their summed cost, the template and guard versions."""

    prm: PrmVerdict | None = None
    hint: HintVerdict | None = None
    guards: list[GuardHit] = []
    usage: JudgeUsage | None = None
    prompt_versions: dict[str, str] = {}


# ---------------------------------------------------------------------------- turns
class TurnRecord(_Record):
    """One recorded main turn, as the policy server writes it (``turns.record``).

    ``prompt_ids`` are exactly what was sent to the engine, ``response_ids`` exactly what it sampled (stop
    token included) with one ``rollout_logprobs`` entry each; ``weight_versions`` lists every engine weight
    version that sampled part of the reply; ``constrained``: decoded under a grammar (masked log-probs).
    """

    chat_template_kwargs: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    rollout_logprobs: list[float] = []
    # {"content", "reasoning_content", "tool_calls", "finish_reason"} of the reply; ``finish_reason`` is the
    # engine's finish type (``stop``, ``length``), absent in records written before it was kept.
    response: dict[str, Any] = {}
    weight_version: str | None = None
    weight_versions: list[str] | None = None
    sampling_params: dict[str, Any] | None = None
    constrained: bool = False
    # The id the client got for this reply (chat ``chatcmpl-...``, Responses ``resp_...``, Messages
    # ``msg_...``): how explicit feedback names its turn.
    response_id: str | None = None
    # Which rule identified the session (header, prompt_cache_key, session_affinity, metadata,
    # previous_response, inferred) and what it decided (continued, started, diverged, after_done, ...).
    session_rule: str | None = None
    session_decision: str | None = None


# The fields of a turn record that grow with its session's history: validated where they are made (the request's
# messages by the API layer, the prompt ids by the renderer) or once as read from the store, and otherwise carried
# and shared as they are, not walked again (TurnRecord.to_json(share=...), policy_server.store.rows.turn_of).
TURN_HISTORY_FIELDS = ("messages", "prompt_ids")

# How a turn's next state was decided: not yet, from the next request, refused, or the session ended.
Pairing = Literal["awaiting", "paired", "mismatch", "session_end"]


class Turn(TurnRecord):
    """A stored turn: the record plus the store's columns (what ``Store.get_turn`` returns)."""

    session_id: str
    turn_index: int
    created_at: float
    pairing: Pairing = "awaiting"
    pairing_note: str | None = None
    next_state: list[dict[str, Any]] | None = None  # the user/tool messages that followed the reply
    session_done: bool = False


# Turn fields the dispatcher copies into the Sample, and the ones the reward pipeline reads.
SAMPLE_TURN_KEYS = (
    "prompt_ids",
    "response_ids",
    "rollout_logprobs",
    "weight_version",
    "weight_versions",
    "sampling_params",
)
# The Sample fields that say where it came from, after the turn's: the sample row's id, the turn's session,
# index and time, and whether it was sampled under a decoding constraint.
SAMPLE_ORIGIN_KEYS = ("sample_id", "session_id", "turn_index", "created_at", "constrained")


class PipelineTurn(_Record):
    """A paired turn as the reward pipeline reads it (policy_server.rewards.modes.RewardPipeline.process):
    what the judge sees (messages, response), what the teacher re-renders (messages, tools and the turn's
    own chat-template kwargs, so its prompt is the rollout's template), the sampled ids it scores, and an
    explicit feedback text the dispatcher passes as the hint (``feedback_hint``). Only what the pipeline
    reads: the prompt ids and rollout log-probs go from the turn to the sample without it."""

    session_id: str
    turn_index: int
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_ids: list[int] = []
    response: dict[str, Any] = {}
    feedback_hint: str | None = None

    @classmethod
    def of(cls, turn: Turn, *, feedback_hint: str | None = None) -> PipelineTurn:
        """The pipeline's fields of a stored turn (``Store.get_turn``); a null field gets its empty value."""
        fields = {k: v for k in cls.model_fields if (v := getattr(turn, k, None)) is not None}
        return cls.model_validate({**fields, "feedback_hint": feedback_hint})


class ScoringTurn(_Record):
    """A turn as the PRM scorers take it (prm.score_session): these fields become the
    Interaction's own, every other key of the turn dict (tools, weight_version, judge_prm, ...) its ``extra``.
    A field the stored turn lacks gets its empty value (a turn scored alone has no parent)."""

    session_id: str
    turn_index: int
    messages: list[dict[str, Any]] = []
    response: dict[str, Any] = {}
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    parent_turn_index: int | None = None
    next_state: list[dict[str, Any]] = []


SCORING_TURN_KEYS = frozenset(ScoringTurn.model_fields)


# ---------------------------------------------------------------------------- samples
class TeacherTopK(_Record):
    """Top-K teacher rows: ``ids`` and ``logprobs`` are ``[T][K]``, one row per response id."""

    ids: list[list[int]]
    logprobs: list[list[float]]


# A Sample as the trainer receives it (``Sample.to_json()``, or a leased JSON object read as is).
SampleJSON = dict[str, Any]


class Sample(_Record):
    """The Sample JSON (docs/CONTRACTS.md "Sample JSON"); field order is the order the dispatcher writes.

    The reward pipeline writes the mode fields (``mode`` .. ``prompt_versions``), the dispatcher then the
    turn's fields (:data:`SAMPLE_TURN_KEYS`) and the origin (``sample_id`` .. ``constrained``); ``feedback``
    last, only on a sample that explicit feedback reached.
    """

    mode: Mode | None = None
    loss_mask: list[int] = []
    reward: float | None = None
    has_reward: bool = False
    has_teacher: bool = False
    prm: PrmVerdict | dict[str, Any] | None = None  # a verdict off the schema is kept as given, for audit
    hint: HintVerdict | dict[str, Any] | None = None
    teacher_logprobs: list[float] | None = None
    teacher_topk: TeacherTopK | None = None
    # The temperature the teacher log-probs were scored at; written with them (always 1.0: the OPD term is
    # derived at T = 1, engine.sample_values refuses any other).
    teacher_temperature: float | None = None
    token_rewards: list[float] | None = None
    w_rl: float = 1.0
    w_opd: float = 1.0
    prompt_versions: dict[str, str] = {}
    # Copied from the turn as recorded (null when a record lacks them; the trainer sets such a sample aside).
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    rollout_logprobs: list[float] | None = None
    weight_version: str | None = None
    weight_versions: list[str] | None = None
    sampling_params: dict[str, Any] | None = None
    sample_id: str | None = None
    session_id: str | None = None
    turn_index: int | None = None
    created_at: float | None = None
    constrained: bool = False
    # Explicit feedback applied to this sample (policy_server.store.feedback_rule): {value, text, policy,
    # judge_reward, count}; absent when the turn got none.
    feedback: dict[str, Any] | None = None
    # Set when leased if a weight version that made it was rolled back (the trainer sets such a sample aside);
    # absent otherwise.
    rolled_back: bool | None = None

    def value_problem(self) -> str | None:
        """None when every learning signal is a usable number, else why not (engine.sample_values)."""
        return value_problem(self.to_json())


# ---------------------------------------------------------------------------- pipeline outcomes
class PipelineOutcome(BaseModel):
    """The policy server's decision on one judged turn: what its ``samples`` row becomes.

    Produced by the reward pipeline (``RewardPipeline.process``), by the dispatcher for a pipeline error and
    a session-scope hold, and by PRM scoring; the dispatcher writes it with ``Store.complete_judge``.
    ``included``: the turn counts for the session's at-least-one rule (true for an accepted turn, also while
    it is held ``pending_score``). ``sample``: the :class:`Sample` with the reward pipeline's fields
    (``mode`` .. ``prompt_versions``; only those set travel in its JSON); the dispatcher adds the turn's.
    ``prompt_versions``: the judge/teacher template versions the verdicts came from (also in ``sample``).
    The outcome is frozen; its sample is never modified in place (a change is a copy).
    """

    model_config = ConfigDict(frozen=True, strict=True)

    status: SampleStatus
    reject_reason: str | None = None
    included: bool = False
    sample: Sample = Field(default_factory=Sample)
    prompt_versions: dict[str, str] = {}

    @classmethod
    def rejected(
        cls, reason: str, sample: Sample | None = None, prompt_versions: dict[str, str] | None = None
    ) -> PipelineOutcome:
        """Not trained on, for ``reason``; ``sample`` keeps what was decided (verdicts, for audit)."""
        return cls(
            status=SampleState.REJECTED,
            reject_reason=reason,
            included=False,
            sample=sample or Sample(),
            prompt_versions=prompt_versions or {},
        )

    @classmethod
    def ready(cls, sample: Sample, prompt_versions: dict[str, str] | None = None) -> PipelineOutcome:
        """Accepted: leasable once stored."""
        return cls(status=SampleState.READY, included=True, sample=sample, prompt_versions=prompt_versions or {})

    def held(self) -> PipelineOutcome:
        """This accepted outcome held ``pending_score`` until its whole session is scored."""
        return self.model_copy(update={"status": SampleState.PENDING_SCORE})


# ---------------------------------------------------------------------------- merged trajectories
class MergedTurn(_Record):
    """One member of a merged trajectory: the sample, and where its response sits in ``token_ids``."""

    sample_id: str | None = None
    turn_index: int
    response_start: int
    response_len: int


class MergedTrajectory(_Record):
    """A session's token-continuous turns as one sequence (engine/trajectories.py): ``token_ids`` is the last
    member's prompt + response; each member's response ids are ``token_ids[response_start:][:response_len]``."""

    session_id: str
    token_ids: list[int]
    turns: list[MergedTurn]


# ---------------------------------------------------------------------------- weight versions
# A weight version's state in the ledger (policy_server.store.versions): ``candidate`` while its weights load,
# ``canary`` while it proves itself on live traffic, ``live`` once everyone gets it (one at a time),
# ``retired`` when a newer version replaced it, ``rolled_back`` when it was judged (or declared) worse.
VersionState = Literal["candidate", "canary", "live", "rolled_back", "retired"]
VERSION_STATES: tuple[str, ...] = get_args(VersionState)


class WeightsUpdated(_Record):
    """A weight update that went through: the version the engines now serve and how long new requests were held."""

    success: Literal[True]
    weight_version: str
    paused_s: float = Field(..., ge=0)


class WeightsPushed(WeightsUpdated):
    """The answer to a trainer's push (``POST /admin/weights/update``): the update, and the version's state in the
    ledger now (``canary`` while it is on trial, else ``live``; absent from a server that keeps no ledger)."""

    state: VersionState | None = None


class WeightVersion(_Record):
    """One row of the weight-version ledger: the checkpoint the engines load for ``version``, the version it
    was trained from (``parent``), the samples it was trained on (count and the smallest and largest sample id),
    when it was made, its state and why that state last changed (``note``). ``parent_required``: a rollback made
    this version live again, so a push must name it as ``parent_version`` (weights reloaded from it) until one
    that does has loaded."""

    version: str
    checkpoint: str
    parent: str | None = None
    state: VersionState = "candidate"
    created_at: float
    updated_at: float
    sample_count: int | None = None
    sample_id_min: str | None = None
    sample_id_max: str | None = None
    note: str | None = None
    parent_required: bool = False


class SessionReward(_Record):
    """One finished, fully judged session of one weight version, as the canary test counts it: the mean of its
    main-turn judge verdicts and explicit feedback values (``signals`` of them), in [-1, 1]."""

    session_id: str
    version: str
    reward: float
    signals: int
    pinned_at: float


class CanaryDrain(BaseModel):
    """A canary decision being carried out (the ``canary_drain`` runtime setting, policy_server.serving.canary):
    new sessions get the surviving version while the losing version's open sessions finish."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    canary: str
    decision: Literal["promote", "rollback"]
    at: float
