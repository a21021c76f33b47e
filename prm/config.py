"""PRM configuration: the YAML file's shape and its validation rules, as pydantic models.

File shape (``examples/prm.yaml``; the AReaL nesting ``rollout.agent.prm`` is accepted too)::

    prm:
      enabled: true                     # false, or an empty scorer list, disables scoring
      advantage_shaping:
        mode: process_weighted          # additive | gvpo | process_weighted
        negative_scale: 0.2             # gvpo only; finite, >= 0
        zero_penalty: 0.4               # gvpo only; finite, >= 0
        zero_eps: 1.0e-6                # finite, >= 0
      scorers:
        - path: prm.scorers.LengthBudgetScorer   # dotted path to a BaseScorer subclass
          weight: 1.0
          enabled: true
          kwargs: {max_output_tokens: 128}
    actor:
      token_rewards_as_adv: true
      mask_no_eos_with_zero: false

Rules (each violation is a ``PRMConfigError`` naming the key):
- ``process_weighted`` rejects ``actor.mask_no_eos_with_zero: true`` (its rewards must be in [0, 1]; the runner
  checks the combined token rewards of every turn at scoring time and rejects values outside);
- ``gvpo`` and ``process_weighted`` need ``actor.token_rewards_as_adv: true``;
- ``actor.token_rewards_as_adv: false`` is rejected while any scorer is active (dense -> whole-turn conversion
  is unspecified);
- active scorers reject ``rollout.api_url`` (external string-only responses are not token-backed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.validation import describe_validation_errors
from prm.errors import PRMConfigError
from prm.scorer import BaseScorer

ShapingMode = Literal["additive", "gvpo", "process_weighted"]


class PRMScorerConfig(BaseModel):
    """One configured scorer: built as ``import(path)(weight=, enabled=, **kwargs)`` and owned by the runner."""

    model_config = ConfigDict(extra="forbid")

    path: str
    weight: float = 1.0
    enabled: bool = True
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _dotted(cls, v: str) -> str:
        parts = v.strip().split(".")
        if parts[:2] == ["judge_server", "prm"]:  # the framework's home before it became its own package
            moved = ".".join(["prm", *parts[2:]])
            raise ValueError(
                f"scorer path {v.strip()!r}: judge_server.prm moved to the top-level package prm; write {moved!r}"
            )
        if len(parts) < 2 or not all(p.isidentifier() for p in parts):
            raise ValueError(f"scorer path must be a dotted Python path like 'pkg.module.Class', got {v!r}")
        return v.strip()

    @field_validator("weight")
    @classmethod
    def _finite_weight(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"scorer weight must be finite, got {v!r}")
        return v

    @field_validator("kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = {"weight", "enabled"} & set(v)
        if reserved:
            raise ValueError(f"set {sorted(reserved)} on the scorer entry, not inside kwargs")
        return v


class PRMAdvantageShapingConfig(BaseModel):
    """How the trainer folds process rewards into advantages (applied after GAE + normalization)."""

    model_config = ConfigDict(extra="forbid")

    mode: ShapingMode = "additive"
    negative_scale: float = 0.2
    zero_penalty: float = 0.4
    zero_eps: float = 1e-6

    @field_validator("negative_scale", "zero_penalty", "zero_eps")
    @classmethod
    def _finite_non_negative(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"must be finite and >= 0, got {v!r}")
        return v


class PRMConfig(BaseModel):
    """The ``prm`` section. ``scorers`` may also hold ``BaseScorer`` instances (borrowed, never closed)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    enabled: bool = True
    advantage_shaping: PRMAdvantageShapingConfig = Field(default_factory=PRMAdvantageShapingConfig)
    scorers: list[PRMScorerConfig | BaseScorer] = Field(default_factory=list)

    @property
    def active(self) -> bool:
        """True when scoring will run: enabled and at least one enabled scorer."""
        return self.enabled and any(s.enabled for s in self.scorers)


class ActorConfig(BaseModel):
    """The trainer-side keys the PRM rules depend on."""

    model_config = ConfigDict(extra="allow")

    token_rewards_as_adv: bool = True
    mask_no_eos_with_zero: bool = False


class RolloutConfig(BaseModel):
    """Rollout keys the PRM rules look at; other keys are kept but ignored here."""

    model_config = ConfigDict(extra="allow")

    api_url: str | None = None


class PRMFileConfig(BaseModel):
    """The whole YAML file: ``prm``, ``actor`` and (optionally) ``rollout``."""

    model_config = ConfigDict(extra="forbid")

    prm: PRMConfig = Field(default_factory=PRMConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="before")
    @classmethod
    def _lift_areal_nesting(cls, data: Any) -> Any:
        # AReaL nests the section at rollout.agent.prm; accept that spelling so its YAML works unchanged.
        if isinstance(data, Mapping) and "prm" not in data:
            rollout = data.get("rollout")
            agent = rollout.get("agent") if isinstance(rollout, Mapping) else None
            if isinstance(rollout, Mapping) and isinstance(agent, Mapping) and "prm" in agent:
                data = dict(data)
                data["prm"] = agent["prm"]
                data["rollout"] = {k: v for k, v in rollout.items() if k != "agent"}
        return data

    @model_validator(mode="after")
    def _cross_rules(self) -> PRMFileConfig:
        mode = self.prm.advantage_shaping.mode
        if mode == "process_weighted" and self.actor.mask_no_eos_with_zero:
            raise ValueError(
                "prm.advantage_shaping.mode=process_weighted rejects actor.mask_no_eos_with_zero=true "
                "(process-weighted advantages need every process reward in [0, 1] on active tokens)"
            )
        if mode in ("gvpo", "process_weighted") and not self.actor.token_rewards_as_adv:
            raise ValueError(f"prm.advantage_shaping.mode={mode} requires actor.token_rewards_as_adv=true")
        if self.prm.active and not self.actor.token_rewards_as_adv:
            raise ValueError(
                "actor.token_rewards_as_adv=false is rejected while PRM scorers are configured "
                "(converting dense process rewards to whole-turn totals is not specified)"
            )
        if self.prm.active and self.rollout.api_url:
            raise ValueError(
                "rollout.api_url (external string-only model) is rejected while PRM scorers are active: "
                "scoring needs token-backed turns"
            )
        return self


def _describe(exc: ValidationError) -> str:
    return describe_validation_errors(exc.errors(), limit=None)


def parse_prm_config(data: Mapping[str, Any] | None, *, source: str = "<mapping>") -> PRMFileConfig:
    """Validate a whole-file mapping; raise ``PRMConfigError`` with every broken key in the message."""
    try:
        return PRMFileConfig.model_validate(dict(data or {}))
    except ValidationError as exc:
        raise PRMConfigError(f"invalid PRM config {source}: {_describe(exc)}") from None


def load_prm_config(path: str | Path) -> PRMFileConfig:
    """Read and validate a PRM YAML file (``--prm-config``)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise PRMConfigError(f"cannot read PRM config {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise PRMConfigError(f"PRM config {p} is not valid YAML: {exc}") from exc
    if data is not None and not isinstance(data, Mapping):
        raise PRMConfigError(f"PRM config {p} must be a mapping at the top level, got {type(data).__name__}")
    return parse_prm_config(data, source=str(p))


def coerce_prm_config(config: PRMConfig | PRMFileConfig | Mapping[str, Any]) -> PRMConfig:
    """Accept a ``PRMConfig``, a whole file config, or a mapping of either shape."""
    if isinstance(config, PRMConfig):
        return config
    if isinstance(config, PRMFileConfig):
        return config.prm
    if isinstance(config, Mapping):
        if "prm" in config or "actor" in config or "rollout" in config:
            return parse_prm_config(config).prm
        try:
            return PRMConfig.model_validate(dict(config))
        except ValidationError as exc:
            raise PRMConfigError(f"invalid PRM config: {_describe(exc)}") from None
    raise PRMConfigError(f"unsupported PRM config type {type(config).__name__}")
