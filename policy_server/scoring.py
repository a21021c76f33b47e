"""Process-reward scorers in the policy server: the PRM runner's lifecycle and per-turn scoring (issue 7 item 9).

Role: when ``--prm-config YAML`` is set and scoring is active (``prm.enabled`` and at least one enabled
scorer), every sample the reward pipeline accepts gets ``token_rewards`` from the configured scorers
(``judge_server.prm``, docs/SCORERS.md) before it can be leased.

Contract:

- Lifespan. ``PRMScoring.start(path)`` loads and validates the YAML and awaits ``PRMRunner.create``; any
  failure raises ``PRMStartupError`` naming the file (the server does not start). ``enabled: false`` or no
  enabled scorer -> ``None``: nothing is built, samples keep ``token_rewards: null``. The runner's metrics are
  registered on the server's Prometheus registry (``hindsight_prm_*`` on ``/metrics``). ``aclose()`` runs
  after the dispatcher stopped (no scoring in flight) and closes the owned scorers once.
- When: the scoring unit is ONE turn, scored as soon as the reward pipeline decided it ``ready`` (so the turn
  is paired with its next state; session-final turns have none and are rejected ``no_next_state`` by the
  pipeline before any scorer runs). Turns the pipeline rejects are not scored. Scoring per turn keeps samples
  flowing from long-lived live sessions; the price is that a ``BaseTrajectoryScorer`` sees one-turn
  trajectories and ``prm_trajectory_reward`` / ``hindsight_prm_sessions_total`` count scored turns.
  ``Interaction.messages`` is still the whole conversation up to the turn and ``ctx["messages"]`` adds the
  answer and its next state. ``extra`` carries ``tools``, ``weight_version`` and the pipeline's verdict
  ``judge_prm`` (so a scorer can reuse it instead of calling the judge again).
- Where: the dispatcher calls :meth:`PRMScoring.score_turn` between the pipeline and the store write, and
  the outcome goes into the SAME ``complete_judge`` transaction as the status. So a sample is never
  ``ready`` without its token_rewards, and a crash before that write leaves it ``pending_judge``: the
  restarted dispatcher judges and scores it again (the persisted pending state is the scoring queue too).
- Outcomes: ``scored`` -> ``token_rewards`` (``len == len(response_ids)``, the weighted sum of all enabled
  scorers). ``PRMRejected`` / ``PRMInputError`` (or any unexpected scoring error) -> the sample is rejected
  with ``prm_rejected: <why>``, loss_mask zeroed, never stored as a reward 0. A scorer failing only because
  a dependency is unreachable (``JudgeUnavailable``, ``EngineUnavailable``, ``EngineTimeout`` anywhere in the
  exception's cause chain) or a closing runner is not a verdict: ``retry`` keeps the sample pending_judge and
  the dispatcher retries it with its capped backoff, like an unreachable judge.
- Metrics: ``drain_window()`` (the runner's window since the previous drain) is returned as ``prm_metrics``
  by ``GET /v1/samples/lease`` when that lease hands out samples; ``summary()`` (cumulative, not draining)
  is ``prm`` in ``GET /v1/samples/stats``. Metrics live in memory: a restart starts them from zero.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import EngineTimeout, EngineUnavailable

logger = logging.getLogger(__name__)

REJECT_PREFIX = "prm_rejected: "


class PRMStartupError(RuntimeError):
    """``--prm-config`` could not be loaded or its scorers could not be built: the server must not start."""


@dataclass(frozen=True)
class ScoreOutcome:
    """What scoring decided for one turn."""

    kind: Literal["scored", "rejected", "retry"]
    token_rewards: list[float] | None = None
    reason: str | None = None


def _unavailable_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [EngineUnavailable, EngineTimeout]
    try:
        from judge_server.errors import JudgeUnavailable

        errs.append(JudgeUnavailable)
    except ImportError:  # pragma: no cover - the judge package ships with the policy server
        pass
    return tuple(errs)


_UNAVAILABLE = _unavailable_errors()


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


def scoring_turn(turn: dict[str, Any], judge_prm: Any = None) -> dict[str, Any]:
    """The ``score_session`` turn dict of one stored turn, scored alone (no parent, its own next state)."""
    return {
        "session_id": turn["session_id"],
        "turn_index": turn["turn_index"],
        "messages": list(turn.get("messages") or []),
        "response": dict(turn.get("response") or {}),
        "prompt_ids": list(turn.get("prompt_ids") or []),
        "response_ids": list(turn.get("response_ids") or []),
        "parent_turn_index": None,
        "next_state": list(turn.get("next_state") or []),
        "tools": turn.get("tools"),
        "weight_version": turn.get("weight_version"),
        "judge_prm": judge_prm if isinstance(judge_prm, dict) else None,
    }


def apply_outcome(result: dict[str, Any], outcome: ScoreOutcome) -> dict[str, Any]:
    """The dispatcher's pipeline result with the scoring outcome folded in (``retry`` is handled by the caller)."""
    sample = dict(result.get("sample") or {})
    if outcome.kind == "scored":
        sample["token_rewards"] = outcome.token_rewards
        return {**result, "sample": sample}
    n = len(sample.get("loss_mask") or [])
    sample.update(token_rewards=None, loss_mask=[0] * n)  # verdicts kept for audit; nothing to train on
    return {**result, "status": "rejected", "reject_reason": outcome.reason, "included": False, "sample": sample}


class PRMScoring:
    """One per policy server: the runner built from ``--prm-config`` plus its counters."""

    def __init__(self, runner: Any, config_path: str, config: Any):
        self.runner = runner
        self.config_path = config_path
        self.config = config
        self.outcomes: dict[str, int] = {"scored": 0, "rejected": 0, "retry": 0}

    @classmethod
    async def start(cls, path: str | None) -> PRMScoring | None:
        """Build the runner from ``path``; None when no path is given or scoring is disabled there."""
        if not path:
            return None
        from judge_server.prm import PRMRunner, load_prm_config

        try:
            config = load_prm_config(path)
            if not config.prm.active:
                logger.info("--prm-config %s: scoring disabled (enabled: false or no enabled scorer); "
                            "samples keep token_rewards null", path)
                return None
            runner = await PRMRunner.create(config)
        except Exception as exc:
            raise PRMStartupError(f"--prm-config {path}: cannot start the PRM scorers: "
                                  f"{type(exc).__name__}: {exc}") from exc
        names = ", ".join(f"{s.name} (weight {s.weight})" for s in runner.scorers if s.enabled)
        logger.info("PRM scoring on from %s: %s; shaping %s", path, names, config.prm.advantage_shaping.mode)
        return cls(runner, path, config)

    def register(self, registry: Any) -> None:
        from judge_server.prm import register_prometheus

        register_prometheus(registry, self.runner.metrics)

    async def score_turn(self, turn: dict[str, Any], judge_prm: Any = None) -> ScoreOutcome:
        """Score one judged turn (a stored turn dict with its ``next_state``); see the module contract."""
        from judge_server.prm import PRMError, PRMInputError, PRMRunnerClosed, score_session

        idx = turn["turn_index"]
        try:
            rewards = await score_session(self.runner, [scoring_turn(turn, judge_prm)], is_eval=False)
        except PRMRunnerClosed as exc:
            return self._count(ScoreOutcome("retry", reason=f"PRMRunnerClosed: {exc}"))
        except Exception as exc:
            cause = unreachable_cause(exc)
            if cause is not None:
                return self._count(ScoreOutcome("retry", reason=f"{type(cause).__name__}: {cause}"))
            if not isinstance(exc, PRMError):  # a scorer-framework bug must not stall the session: reject visibly
                logger.exception("PRM scoring failed on %s/%s", turn["session_id"], idx)
                why = f"{type(exc).__name__}: {exc}"
            else:
                why = f"not scorable: {exc}" if isinstance(exc, PRMInputError) else str(exc)
            return self._count(ScoreOutcome("rejected", reason=REJECT_PREFIX + why))
        got = rewards.get(idx)
        n = len(turn.get("response_ids") or [])
        if got is None or len(got) != n:
            return self._count(ScoreOutcome(
                "rejected", reason=f"{REJECT_PREFIX}expected {n} token rewards for turn {idx}, got "
                                   f"{'none' if got is None else len(got)}"))
        return self._count(ScoreOutcome("scored", token_rewards=[float(v) for v in got]))

    def _count(self, outcome: ScoreOutcome) -> ScoreOutcome:
        self.outcomes[outcome.kind] += 1
        return outcome

    def drain_window(self) -> dict[str, float]:
        return self.runner.metrics.drain_window()

    def summary(self) -> dict[str, Any]:
        """Cumulative view for GET /v1/samples/stats (does not drain the window)."""
        return {
            "enabled": True,
            "config": self.config_path,
            "advantage_shaping": self.config.prm.advantage_shaping.mode,
            "scorers": [{"name": s.name, "weight": s.weight} for s in self.runner.scorers if s.enabled],
            "turns": dict(self.outcomes),
            "sessions": {f"{ns}/{outcome}": n for (ns, outcome), n in sorted(self.runner.metrics.sessions.items())},
            "metrics": self.runner.metrics.snapshot(),
        }

    async def aclose(self) -> None:
        try:
            await self.runner.aclose()
        except Exception:  # noqa: BLE001 - an ExceptionGroup of scorer cleanups; shutdown continues
            logger.exception("closing the PRM scorers failed")
