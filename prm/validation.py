"""Pure checks the runner applies to every scorer result before anything is committed.

- ``to_token_rewards(reward, output_len)``: a number (not a string, not None) is broadcast to
  ``[output_len]``; a tensor/list must have exactly shape ``(output_len,)``; values must be finite.
- ``check_observations``: each item is a ``PRMMetricObservation``; a turn observation's ``target_id`` is the
  interaction id; one observation per (scope, target, metric) per scorer run; the (value_type, aggregations)
  schema per (scope, metric) is identical within the run and to the schema bound by earlier runs.
All failures are ``TypeError``/``ValueError`` with a message; the runner turns them into ``PRMRejected``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from prm.types import PRMMetricObservation

Schema = tuple[str, tuple[str, ...]]


def to_token_rewards(reward: Any, output_len: int) -> torch.Tensor:
    """Unweighted per-token rewards (float32, CPU) for one turn with ``output_len`` generated tokens."""
    if output_len <= 0:
        raise ValueError("the turn has no generated tokens to reward")
    if isinstance(reward, torch.Tensor):
        tokens = reward.detach().to(device="cpu", dtype=torch.float32)
    elif isinstance(reward, numbers.Real):
        tokens = torch.full((output_len,), float(reward), dtype=torch.float32)
    elif isinstance(reward, Sequence) and not isinstance(reward, str | bytes):
        try:
            tokens = torch.tensor([float(v) for v in reward], dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"dense reward must hold numbers: {exc}") from None
    else:
        raise TypeError(f"reward must be a number or a [output_len] tensor, got {type(reward).__name__}")
    if tokens.shape != torch.Size((output_len,)):
        raise ValueError(f"dense reward must have shape ({output_len},), got {tuple(tokens.shape)}")
    if not bool(torch.isfinite(tokens).all()):
        raise ValueError("reward contains non-finite values")
    return tokens


def check_observations(
    observations: Any,
    interaction_id: str,
    seen_keys: set[tuple[str, str, str]],
    run_schemas: dict[tuple[str, str], Schema],
    bound_schemas: Mapping[tuple[str, str], Schema],
) -> tuple[PRMMetricObservation, ...]:
    """Validate one result's observations; updates ``seen_keys`` and ``run_schemas`` in place."""
    if not isinstance(observations, Sequence) or isinstance(observations, str | bytes):
        raise TypeError(f"observations must be a sequence, got {type(observations).__name__}")
    out = []
    for obs in observations:
        if not isinstance(obs, PRMMetricObservation):
            raise TypeError(f"observations must be PRMMetricObservation, got {type(obs).__name__}")
        if obs.scope == "turn" and obs.target_id != interaction_id:
            raise ValueError(f"turn metric {obs.metric_id!r} targets {obs.target_id!r}, expected {interaction_id!r}")
        key = (obs.scope, obs.target_id, obs.metric_id)
        if key in seen_keys:
            raise ValueError(f"duplicate observation {key!r}")
        seen_keys.add(key)
        schema_key = (obs.scope, obs.metric_id)
        first = run_schemas.setdefault(schema_key, obs.schema)
        if first != obs.schema:
            raise ValueError(f"metric {schema_key!r} schema changed within one run: {first!r} -> {obs.schema!r}")
        bound = bound_schemas.get(schema_key)
        if bound is not None and bound != obs.schema:
            raise ValueError(f"metric {schema_key!r} schema changed across runs: {bound!r} -> {obs.schema!r}")
        out.append(obs)
    return tuple(out)
