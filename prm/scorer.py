"""The scorer contract users subclass (AReaL ``BaseScorer`` / ``BaseTrajectoryScorer`` semantics).

``BaseScorer``:
- a unique, non-empty class-level ``name`` (the metric namespace; two scorers in one runner may not share it);
- ``__init__(weight=1.0, enabled=True)``; subclasses add their own keyword arguments (the YAML ``kwargs``);
- ``async evaluate(interaction, ctx)`` returns an *unweighted* scalar (broadcast over the turn's output tokens)
  or a tensor of shape ``[interaction.output_len]`` (kept per token). ``None`` or an exception rejects the whole
  trajectory; an intentional zero is ``0.0``. The runner multiplies by ``weight``;
- ``ctx`` is read-only: ``ctx["messages"]`` is the branch's full conversation, ``ctx["is_eval"]`` the namespace;
- instances may be shared by concurrent sessions: keep request state inside the coroutine, never on ``self``;
- ``prepare_result`` / ``evaluate_result`` may attach ``PRMMetricObservation``s via ``PRMScorerResult``;
- ``validate_prm_config(config, *, training_enabled)`` may reject incompatible shaping modes at startup;
- ``async aclose()`` is an optional cleanup hook (no-op default) for clients the scorer owns. The runner adds
  no timeout or retry: bound external I/O inside the hook.

``BaseTrajectoryScorer``: ``evaluate_trajectory(interactions, ctx)`` receives the branch's turns parent-before-
child and returns ``{interaction_id: reward}``; missing ids get 0.0, unknown ids reject; ``None`` rejects.
Its per-turn ``evaluate`` is not used and raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from prm.types import Interaction, PRMScorerResult, RawReward


class ShapingView(Protocol):
    """What a scorer may read of the advantage shaping (prm.config.PRMAdvantageShapingConfig)."""

    @property
    def mode(self) -> str: ...


class PRMConfigView(Protocol):
    """What a scorer may read of the ``prm`` section it serves (prm.config.PRMConfig has it): the
    config builds scorers, so the scorer contract names only these fields, not the config module."""

    @property
    def enabled(self) -> bool: ...

    @property
    def advantage_shaping(self) -> ShapingView: ...


class BaseScorer:
    """Base class of per-turn process-reward scorers."""

    name: ClassVar[str] = ""

    def __init__(self, weight: float = 1.0, enabled: bool = True):
        if not isinstance(type(self).name, str) or not type(self).name.strip():
            raise ValueError(f"{type(self).__name__} must define a non-empty class-level `name`")
        self.weight = float(weight)
        self.enabled = bool(enabled)

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> RawReward | None:
        """Return an unweighted scalar or ``[output_len]`` tensor; ``None`` rejects the trajectory."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate")

    def prepare_result(self, interaction: Interaction, result: RawReward, ctx: Mapping[str, Any]) -> PRMScorerResult:
        """Attach observations to one unweighted result (override for structured monitoring)."""
        del interaction, ctx
        return PRMScorerResult(reward=result)

    async def evaluate_result(self, interaction: Interaction, ctx: Mapping[str, Any]) -> PRMScorerResult | None:
        """Evaluate and prepare one turn in the same task (override to return structured results directly)."""
        result = await self.evaluate(interaction, ctx)
        if result is None:
            return None
        return self.prepare_result(interaction, result, ctx)

    def validate_prm_config(self, config: PRMConfigView, *, training_enabled: bool) -> None:
        """Raise ``ValueError`` when this scorer cannot serve ``config`` (e.g. its shaping mode)."""
        del config, training_enabled

    async def aclose(self) -> None:
        """Release resources this scorer owns; called at most once by the runner that created it."""


class BaseTrajectoryScorer(BaseScorer):
    """Base class of scorers that judge a whole branch jointly."""

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> RawReward | None:
        del interaction, ctx
        raise RuntimeError(f"{type(self).__name__} is a trajectory scorer: run it through PRMRunner")

    async def evaluate_trajectory(
        self, interactions: Sequence[Interaction], ctx: Mapping[str, Any]
    ) -> Mapping[str, RawReward | None] | None:
        """Return unweighted rewards keyed by interaction id (parent-before-child input order)."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate_trajectory")
