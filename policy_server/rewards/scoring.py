"""Process-reward scorers in the policy server: the PRM runner's lifecycle, per-turn and per-session scoring.

Role: when ``--prm-config YAML`` is set and scoring is active (``prm.enabled`` and at least one enabled
scorer), every sample the reward pipeline accepts gets ``token_rewards`` from the configured scorers
(``prm``, docs/SCORERS.md) before it can be leased.

Contract:

- Lifespan. ``PRMScoring.start(path)`` loads and validates the YAML and awaits ``PRMRunner.create``; any
  failure raises ``PRMStartupError`` naming the file (the server does not start). ``enabled: false`` or no
  enabled scorer -> ``None``: nothing is built, samples keep ``token_rewards: null``. The runner's metrics are
  registered on the server's Prometheus registry (``hindsight_prm_*`` on ``/metrics``). ``aclose()`` runs
  after the dispatcher stopped (no scoring in flight) and closes the owned scorers once.
- When (``--prm-scope``, default ``turn``):

  * ``turn``: the scoring unit is ONE turn, scored as soon as the reward pipeline decided it ``ready`` (so
    the turn is paired with its next state; session-final turns have none and are rejected
    ``no_next_state`` by the pipeline before any scorer runs). Turns the pipeline rejects are not scored.
    Scoring per turn keeps samples flowing from long-lived live sessions; the price is that a
    ``BaseTrajectoryScorer`` sees one-turn trajectories and ``prm_trajectory_reward`` /
    ``hindsight_prm_sessions_total`` count scored turns. The dispatcher calls :meth:`PRMScoring.score_turn`
    between the pipeline and the store write, and the outcome goes into the SAME ``complete_judge``
    transaction as the status; a crash before that write leaves the sample ``pending_judge`` and the
    restarted dispatcher judges and scores it again (the persisted pending state is the scoring queue).
  * ``session``: a turn the pipeline accepts is stored ``pending_score`` (its Sample JSON persisted, not
    leasable) instead of ``ready``. When the session has ended (``X-Session-Done`` or the idle timeout) and
    every turn of it is decided (none awaiting its next state, none ``pending_judge``), the dispatcher
    calls :meth:`PRMScoring.score_held_session` with the whole session (:func:`session_turns`: every
    resolved turn, parent-before-child as a linear chain, each with its stored next state; rejected turns
    and the final turn without a next state are context and get no sample), and ``Store.complete_score``
    makes every held sample ``ready`` with its token_rewards, or ``rejected``, in ONE transaction. A crash
    while held leaves them ``pending_score`` and the restarted dispatcher scores the session (the persisted
    held state is the queue). A session reopened after being scored is scored again when it ends next
    (earlier turns are context then, never re-trained). Turn scorers run on every turn of the trajectory,
    so an ``LLMJudgeScorer`` there needs ``missing_next_state: zero`` (the final turn has no next state).
  * Both: ``Interaction.messages`` is the whole conversation up to the turn and ``ctx["messages"]`` adds
    the branch's last answer and its next state. ``extra`` carries ``tools``, ``weight_version`` and the
    pipeline's verdict ``judge_prm`` (so a scorer can reuse it instead of calling the judge again);
    session scope adds ``sample_status`` and ``reject_reason``.
- Outcomes: ``scored`` -> ``token_rewards`` (``len == len(response_ids)``, the weighted sum of all enabled
  scorers). ``PRMRejected`` / ``PRMInputError`` (or any unexpected scoring error) -> the sample is rejected
  with ``prm_rejected: <why>``, loss_mask zeroed, never stored as a reward 0. A scorer failing only because
  a dependency is unreachable (``JudgeUnavailable``, ``EngineUnavailable``, ``EngineTimeout`` anywhere in the
  exception's cause chain) or a closing runner is not a verdict: ``retry`` keeps the sample pending_judge
  (session scope: the held samples ``pending_score``, attempts and last error noted on each) and the
  dispatcher retries it with its capped backoff, like an unreachable judge. In session scope a rejection
  (scorer veto, not scorable) rejects every held sample of the session with the same reason.
- Metrics: ``drain_window()`` (the runner's window since the previous drain) is returned as ``prm_metrics``
  by ``GET /v1/samples/lease`` when that lease hands out samples; ``summary()`` (cumulative, not draining)
  is ``prm`` in ``GET /v1/samples/stats``. Metrics live in memory: a restart starts them from zero.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry

from engine.errors import EngineTimeout, EngineUnavailable
from engine.records import (
    SCORING_TURN_KEYS,
    PipelineOutcome,
    PrmVerdict,
    RejectReason,
    Sample,
    SampleState,
    ScoringTurn,
    Turn,
)
from judge_server.errors import JudgeUnavailable
from policy_server.store.records import SampleRow, ScoredSample, TrajectoryTurn

if TYPE_CHECKING:  # the PRM package loads only when --prm-config is given (PRMScoring.start)
    from prm import PRMRunner
    from prm.config import PRMFileConfig

logger = logging.getLogger(__name__)

REJECT_PREFIX = f"{RejectReason.PRM_REJECTED}: "


class PRMStartupError(RuntimeError):
    """``--prm-config`` could not be loaded or its scorers could not be built: the server must not start."""


@dataclass(frozen=True)
class ScoreOutcome:
    """What scoring decided for one turn."""

    kind: Literal["scored", "rejected", "retry"]
    token_rewards: list[float] | None = None
    reason: str | None = None


@dataclass(frozen=True)
class SessionOutcome:
    """What scoring decided for a whole session's held samples (``prm_scope: session``)."""

    kind: Literal["scored", "rejected", "retry"]
    token_rewards: dict[int, list[float]] = field(default_factory=dict)  # held turn_index -> rewards
    reason: str | None = None


# A scorer failing for one of these (anywhere in its cause chain) lost a dependency: retry, never a verdict.
_UNAVAILABLE: tuple[type[BaseException], ...] = (EngineUnavailable, EngineTimeout, JudgeUnavailable)


def unreachable_cause(exc: BaseException) -> BaseException | None:
    """The first "dependency unreachable" error in ``exc``'s cause/context chain, if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, _UNAVAILABLE):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def scoring_turn(turn: Turn, judge_prm: object = None) -> dict[str, object]:
    """The ``score_session`` turn dict of one stored turn, scored alone (no parent, its own next state): the
    :class:`~engine.records.ScoringTurn` fields (copied), then its ``extra``: tools, weight version and the
    pipeline's PRM verdict as its JSON (a stored verdict is already JSON; anything else is no verdict). The dict is the scorer framework's
    input (prm.score_session), built here and nowhere else."""
    if isinstance(judge_prm, PrmVerdict):
        judge_prm = judge_prm.to_json()
    recorded = turn.to_json()
    own = {k: recorded[k] for k in SCORING_TURN_KEYS - {"parent_turn_index"} if recorded.get(k) is not None}
    return {
        **ScoringTurn.model_validate(own).model_dump(),
        "tools": turn.tools,
        "weight_version": turn.weight_version,
        "judge_prm": judge_prm if isinstance(judge_prm, dict) else None,
    }


def session_turns(trajectory: list[TrajectoryTurn]) -> list[dict[str, object]]:
    """The ``score_session`` turn dicts of a finished session (``Store.session_trajectory``).

    Every turn whose pairing is resolved is in, decided or not trained on alike (rejected turns and the final
    turn without a next state are context); a turn still awaiting its next state (recorded after the session
    was reopened) belongs to the next scoring and is left out. Linear chain in turn order: each turn's parent
    is the previous recorded turn; ``next_state`` is the stored one (``[]`` when there is none). ``extra``
    adds the sample's ``sample_status`` and ``reject_reason`` so a scorer can tell context from trained turns.
    """
    out: list[dict[str, object]] = []
    prev: int | None = None
    for t in trajectory:
        if t.sample is None:
            continue
        d = scoring_turn(t.turn, (t.sample.sample or {}).get("prm"))
        d.update(parent_turn_index=prev, sample_status=t.sample.status, reject_reason=t.sample.reject_reason)
        out.append(d)
        prev = t.turn.turn_index
    return out


def held_samples(trajectory: list[TrajectoryTurn]) -> list[tuple[Turn, SampleRow]]:
    """The trajectory's turns held ``pending_score``, each with its sample row."""
    return [
        (t.turn, t.sample) for t in trajectory if t.sample is not None and t.sample.status == SampleState.PENDING_SCORE
    ]


def held_outcomes(trajectory: list[TrajectoryTurn], outcome: SessionOutcome) -> list[ScoredSample]:
    """``Store.complete_score`` rows for the held samples of a ``scored`` or ``rejected`` session outcome."""
    rows = []
    for turn, sample in held_samples(trajectory):
        one = (
            ScoreOutcome("scored", token_rewards=outcome.token_rewards[turn.turn_index])
            if outcome.kind == "scored"
            else ScoreOutcome("rejected", reason=outcome.reason)
        )
        res = apply_outcome(PipelineOutcome.ready(Sample.model_validate(sample.sample or {})), one)
        rows.append(ScoredSample(sample.sample_id, res.status, res.reject_reason, res.sample))
    return rows


def apply_outcome(result: PipelineOutcome, outcome: ScoreOutcome) -> PipelineOutcome:
    """The pipeline's outcome with the scoring outcome folded in (``retry`` is handled by the caller)."""
    # A copy that re-validates: the update is checked and counts as set (it travels in the sample's JSON).
    if outcome.kind == "scored":
        scored = Sample.model_validate({**result.sample.to_json(), "token_rewards": outcome.token_rewards})
        return result.model_copy(update={"sample": scored})
    n = len(result.sample.loss_mask)
    # verdicts kept for audit; nothing to train on
    rejected = Sample.model_validate({**result.sample.to_json(), "token_rewards": None, "loss_mask": [0] * n})
    return PipelineOutcome.rejected(outcome.reason or RejectReason.PRM_REJECTED, rejected, result.prompt_versions)


class PRMScoring:
    """One per policy server: the runner built from ``--prm-config`` plus its counters."""

    def __init__(self, runner: PRMRunner, config_path: str, config: PRMFileConfig, *, scope: str = "turn"):
        if scope not in ("turn", "session"):
            raise ValueError(f"prm_scope must be turn or session, not {scope!r}")
        self.runner = runner
        self.config_path = config_path
        self.config = config
        self.scope = scope
        self.outcomes: dict[str, int] = {"scored": 0, "rejected": 0, "retry": 0}

    @classmethod
    async def start(cls, path: str | None, *, scope: str = "turn") -> PRMScoring | None:
        """Build the runner from ``path``; None when no path is given or scoring is disabled there."""
        if not path:
            return None
        from prm import PRMRunner, load_prm_config

        try:
            config = load_prm_config(path)
            if not config.prm.active:
                logger.info(
                    "--prm-config %s: scoring disabled (enabled: false or no enabled scorer); "
                    "samples keep token_rewards null",
                    path,
                )
                return None
            runner = await PRMRunner.create(config)
        except Exception as exc:
            raise PRMStartupError(
                f"--prm-config {path}: cannot start the PRM scorers: {type(exc).__name__}: {exc}"
            ) from exc
        names = ", ".join(f"{s.name} (weight {s.weight})" for s in runner.scorers if s.enabled)
        logger.info(
            "PRM scoring on from %s: %s; shaping %s; scope %s", path, names, config.prm.advantage_shaping.mode, scope
        )
        return cls(runner, path, config, scope=scope)

    def register(self, registry: CollectorRegistry) -> None:
        from prm import register_prometheus

        register_prometheus(registry, self.runner.metrics)

    async def score_turn(self, turn: Turn, judge_prm: PrmVerdict | dict[str, object] | None = None) -> ScoreOutcome:
        """Score one judged turn (a stored turn with its ``next_state``); see the module contract."""
        from prm import score_session

        idx = turn.turn_index
        try:
            rewards = await score_session(self.runner, [scoring_turn(turn, judge_prm)], is_eval=False)
        except Exception as exc:  # noqa: BLE001 (user scorer code: any failure becomes an explicit outcome)
            return self._count(self._failure(exc, f"{turn.session_id}/{idx}"))
        got = rewards.get(idx)
        n = len(turn.response_ids)
        if got is None or len(got) != n:
            return self._count(
                ScoreOutcome(
                    "rejected",
                    reason=f"{REJECT_PREFIX}expected {n} token rewards for turn {idx}, got "
                    f"{'none' if got is None else len(got)}",
                )
            )
        return self._count(ScoreOutcome("scored", token_rewards=[float(v) for v in got]))

    async def score_held_session(self, trajectory: list[TrajectoryTurn]) -> SessionOutcome:
        """Score a finished session at once (``prm_scope: session``); ``trajectory`` is
        ``Store.session_trajectory``. Every decided turn is part of the trajectory; only the held
        (``pending_score``) ones get rewards. All-or-nothing: a rejection covers every held sample."""
        from prm import score_session

        turns = session_turns(trajectory)
        held = held_samples(trajectory)
        sid = trajectory[0].turn.session_id if trajectory else "?"
        try:
            rewards = await score_session(self.runner, turns, is_eval=False)
        except Exception as exc:  # noqa: BLE001 (user scorer code: any failure becomes an explicit outcome)
            out = self._failure(exc, sid)
            return self._count_session(SessionOutcome(out.kind, reason=out.reason), len(held))
        per_turn: dict[int, list[float]] = {}
        for turn, _ in held:
            idx, n = turn.turn_index, len(turn.response_ids)
            got = rewards.get(idx)
            # The per-turn check of score() above, for a whole session (each counts its own outcome).
            if got is None or len(got) != n:
                return self._count_session(
                    SessionOutcome(
                        "rejected",
                        reason=f"{REJECT_PREFIX}expected {n} token rewards for turn {idx}, got "
                        f"{'none' if got is None else len(got)}",
                    ),
                    len(held),
                )
            per_turn[idx] = [float(v) for v in got]
        return self._count_session(SessionOutcome("scored", token_rewards=per_turn), len(held))

    def _failure(self, exc: BaseException, where: str) -> ScoreOutcome:
        """Map a scoring exception: dependency unreachable or runner closing -> retry, else a rejection."""
        from prm import PRMError, PRMInputError, PRMRunnerClosed

        if isinstance(exc, PRMRunnerClosed):
            return ScoreOutcome("retry", reason=f"PRMRunnerClosed: {exc}")
        cause = unreachable_cause(exc)
        if cause is not None:
            return ScoreOutcome("retry", reason=f"{type(cause).__name__}: {cause}")
        if not isinstance(exc, PRMError):  # a scorer-framework bug must not stall the session: reject visibly
            logger.error("PRM scoring failed on %s", where, exc_info=exc)
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = f"not scorable: {exc}" if isinstance(exc, PRMInputError) else str(exc)
        return ScoreOutcome("rejected", reason=REJECT_PREFIX + why)

    def _count_session(self, outcome: SessionOutcome, held: int) -> SessionOutcome:
        # Counters are per turn (sample), like turn scope; a retry counts once per attempt.
        self.outcomes[outcome.kind] += 1 if outcome.kind == "retry" else held
        return outcome

    def _count(self, outcome: ScoreOutcome) -> ScoreOutcome:
        self.outcomes[outcome.kind] += 1
        return outcome

    def drain_window(self) -> dict[str, float]:
        return self.runner.metrics.drain_window()

    def summary(self) -> dict[str, object]:
        """Cumulative view for GET /v1/samples/stats (does not drain the window)."""
        return {
            "enabled": True,
            "config": self.config_path,
            "scope": self.scope,
            "advantage_shaping": self.config.prm.advantage_shaping.mode,
            "scorers": [{"name": s.name, "weight": s.weight} for s in self.runner.scorers if s.enabled],
            "turns": dict(self.outcomes),
            "sessions": {f"{ns}/{outcome}": n for (ns, outcome), n in sorted(self.runner.metrics.sessions.items())},
            "metrics": self.runner.metrics.snapshot(),
        }

    async def aclose(self) -> None:
        try:
            await self.runner.aclose()
        except Exception:  # an ExceptionGroup of scorer cleanups; shutdown continues
            logger.exception("closing the PRM scorers failed")
