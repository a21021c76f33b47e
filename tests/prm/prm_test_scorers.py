"""Scorer classes the PRM tests reference by dotted path (``tests.prm.prm_test_scorers.X``); they log to ``LOG``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from prm import BaseScorer, BaseTrajectoryScorer, PRMMetricObservation, PRMScorerResult

LOG: list[tuple[str, str]] = []


class _Recording(BaseScorer):
    """Returns ``reward``; logs evaluate/close; options to fail or stall in construction and cleanup."""

    def __init__(
        self,
        reward: float = 1.0,
        fail_init: bool = False,
        fail_close: bool = False,
        close_delay_s: float = 0.0,
        weight: float = 1.0,
        enabled: bool = True,
    ):
        if fail_init:
            LOG.append(("init_failed", self.name))
            raise RuntimeError(f"{self.name} constructor failed")
        super().__init__(weight=weight, enabled=enabled)
        self.reward = reward
        self.fail_close = fail_close
        self.close_delay_s = close_delay_s
        LOG.append(("init", self.name))

    async def evaluate(self, interaction, ctx):
        LOG.append(("evaluate", f"{self.name}:{interaction.interaction_id}"))
        return self.reward

    async def aclose(self) -> None:
        LOG.append(("close_start", self.name))
        if self.close_delay_s:
            await asyncio.sleep(self.close_delay_s)
        if self.fail_close:
            raise RuntimeError(f"{self.name} cleanup failed")
        LOG.append(("closed", self.name))


class A(_Recording):
    name = "a"


class B(_Recording):
    name = "b"


class C(_Recording):
    name = "c"


class D(_Recording):
    name = "d"


class AlsoNamedA(_Recording):
    name = "a"


class RejectsProcessWeighted(_Recording):
    name = "rejects_pw"

    def validate_prm_config(self, config, *, training_enabled: bool) -> None:
        if config.advantage_shaping.mode == "process_weighted":
            raise ValueError("rejects_pw cannot be used with process_weighted")


class NotAScorer:
    name = "nope"


class Scripted(BaseScorer):
    """Per-turn results from a mapping turn_index -> value; a value may be an exception to raise."""

    name = "scripted"

    def __init__(self, script: Mapping[int, Any], weight: float = 1.0, enabled: bool = True):
        super().__init__(weight=weight, enabled=enabled)
        self.script = dict(script)

    async def evaluate(self, interaction, ctx):
        value = self.script[interaction.turn_index]
        if isinstance(value, BaseException):
            raise value
        if callable(value):
            return value(interaction, ctx)
        return value


class Observing(BaseScorer):
    """Reward 1.0 with one observation built by ``make_obs(interaction)`` (schema tests)."""

    name = "observing"

    def __init__(self, make_obs, weight: float = 1.0, enabled: bool = True):
        super().__init__(weight=weight, enabled=enabled)
        self.make_obs = make_obs

    async def evaluate_result(self, interaction, ctx):
        return PRMScorerResult(1.0, tuple(self.make_obs(interaction)))


class Trajectory(BaseTrajectoryScorer):
    """Returns ``fn(interactions) -> mapping``; records the order it saw."""

    name = "trajectory"

    def __init__(self, fn, weight: float = 1.0, enabled: bool = True):
        super().__init__(weight=weight, enabled=enabled)
        self.fn = fn
        self.seen: list[list[str]] = []

    async def evaluate_trajectory(self, interactions, ctx):
        self.seen.append([it.interaction_id for it in interactions])
        return self.fn(interactions)


def dense(values: list[float]):
    return lambda interaction, ctx: torch.tensor(values)


def obs(metric_id: str, target: str, value: Any, value_type: str, aggs: tuple[str, ...], scope: str = "turn"):
    return PRMMetricObservation(metric_id, scope, target, value, value_type, aggs)


def make_turns(n: int, session_id: str = "s1", out_lens: list[int] | None = None) -> list[dict]:
    """A linear session of ``n`` token-backed turns, each with a user reply as next state."""
    turns = []
    msgs: list[dict] = [{"role": "user", "content": "q0"}]
    for i in range(n):
        out_len = out_lens[i] if out_lens else 2 + i
        turns.append(
            {
                "session_id": session_id,
                "turn_index": i,
                "messages": list(msgs),
                "response": {"content": f"a{i}", "reasoning_content": None, "tool_calls": []},
                "prompt_ids": list(range(1, 4 + i)),
                "response_ids": [7] * (out_len - 1) + [2],
            }
        )
        msgs = msgs + [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i + 1}"}]
    return turns
