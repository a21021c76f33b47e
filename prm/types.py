"""Value types shared by scorers, the runner and the metrics: interactions, results, observations.

Contract (AReaL ``areal.reward.prm``, see docs/SCORERS.md):

- ``Interaction`` is one token-backed assistant turn, frozen: ``messages`` (the prompt context as sent),
  ``response`` (``content``/``reasoning_content``/``tool_calls``), ``next_state`` (the user/tool messages that
  followed, possibly empty), ``prompt_ids``/``response_ids`` (exact engine ids). ``output_len`` is
  ``len(response_ids)``; a dense scorer result must have that shape. All mappings are read-only views.
- ``PRMScorerResult(reward, observations)``: an unweighted reward (scalar or ``[output_len]`` tensor) plus
  typed monitoring observations.
- ``PRMMetricObservation``: ``metric_id``, ``scope`` (``turn`` | ``trajectory``), ``target_id``, ``value``,
  ``value_type`` (``boolean``: aggregations ``count``/``rate``; ``float``: ``sum``/``mean``), non-empty unique
  ``aggregations``. Booleans must be real ``bool``; floats finite. A turn observation targets its own
  interaction id (checked by the runner).
- ``PRMTurnResult``: what the runner committed for one scorer and turn; ``reward`` is the mean of the
  *weighted* per-token contribution (the value behind ``prm_turn_reward/<scorer>``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

Scope = Literal["turn", "trajectory"]
ValueType = Literal["float", "boolean"]
Aggregation = Literal["count", "rate", "sum", "mean"]
RawReward = float | torch.Tensor

ALLOWED_AGGREGATIONS: dict[str, frozenset[str]] = {
    "boolean": frozenset({"count", "rate"}),
    "float": frozenset({"sum", "mean"}),
}


def freeze(value: Any) -> Any:
    """A deep read-only copy: dicts become MappingProxyType, lists become tuples.

    Scorers may be shared by concurrent sessions and must not mutate their inputs; freezing makes an
    accidental write fail loudly instead of leaking into another branch.
    """
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain mutable (JSON-ready) copy of a frozen value, for sending it over HTTP."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class Interaction:
    """One token-backed assistant turn of a session, as a scorer sees it (read-only)."""

    interaction_id: str
    session_id: str
    turn_index: int
    parent_id: str | None
    messages: tuple[Mapping[str, Any], ...]
    response: Mapping[str, Any]
    next_state: tuple[Mapping[str, Any], ...]
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def output_len(self) -> int:
        return len(self.response_ids)


@dataclass(frozen=True)
class PRMMetricObservation:
    """One unweighted, schema-carrying monitoring value produced by a scorer."""

    metric_id: str
    scope: Scope
    target_id: str
    value: float | bool
    value_type: ValueType
    aggregations: tuple[Aggregation, ...]

    def __post_init__(self) -> None:
        for name in ("metric_id", "target_id"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"PRMMetricObservation.{name} must be a non-empty string, got {v!r}")
        if self.scope not in ("turn", "trajectory"):
            raise ValueError(f"PRMMetricObservation.scope must be 'turn' or 'trajectory', got {self.scope!r}")
        if self.value_type not in ALLOWED_AGGREGATIONS:
            raise ValueError(f"PRMMetricObservation.value_type must be 'float' or 'boolean', got {self.value_type!r}")
        aggs = tuple(self.aggregations)
        object.__setattr__(self, "aggregations", aggs)
        if not aggs or len(set(aggs)) != len(aggs):
            raise ValueError(f"metric {self.metric_id!r}: aggregations must be non-empty and unique, got {aggs!r}")
        bad = set(aggs) - ALLOWED_AGGREGATIONS[self.value_type]
        if bad:
            allowed = sorted(ALLOWED_AGGREGATIONS[self.value_type])
            raise ValueError(f"metric {self.metric_id!r}: {self.value_type} values allow {allowed}, not {sorted(bad)}")
        if self.value_type == "boolean":
            if not isinstance(self.value, bool):
                raise TypeError(f"metric {self.metric_id!r}: boolean value must be a bool, got {self.value!r}")
        elif isinstance(self.value, bool) or not isinstance(self.value, int | float):
            raise TypeError(f"metric {self.metric_id!r}: float value must be a number, got {self.value!r}")
        elif not math.isfinite(float(self.value)):
            raise ValueError(f"metric {self.metric_id!r}: float value must be finite, got {self.value!r}")

    @property
    def schema(self) -> tuple[str, tuple[str, ...]]:
        """What must stay stable per scorer and (scope, metric): value type and aggregations."""
        return (self.value_type, self.aggregations)


@dataclass(frozen=True)
class PRMScorerResult:
    """A raw (unweighted) reward plus its observations."""

    reward: RawReward
    observations: Sequence[PRMMetricObservation] = ()


@dataclass(frozen=True)
class PRMTurnResult:
    """The committed value of one scorer for one turn (weighted mean per token) and its observations."""

    scorer_name: str
    interaction_id: str
    reward: float
    observations: tuple[PRMMetricObservation, ...] = ()
