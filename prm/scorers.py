"""Built-in scorers: ``LengthBudgetScorer`` (dependency-free example) and ``LLMJudgeScorer`` (the judge service).

``LengthBudgetScorer(max_output_tokens=128)`` — name ``length_budget``: 1.0 when the turn generated at most
``max_output_tokens`` tokens, else 0.0 (bounded, so usable with ``process_weighted``). The budget is not the
generation limit: exceeding it never truncates. Observation: turn/boolean ``within_budget`` (count, rate) and
turn/float ``output_tokens`` (sum, mean).

``LLMJudgeScorer(judge_url, api_key=None, m=None, reward_range="signed", missing_next_state="reject",
timeout_s=120, deadline_s=300)`` — name
``llm_judge``: ``POST /v1/judge`` with tasks ``["prm"]`` through ``judge_server.client.JudgeClient`` for
(context, response, next_state) of each turn. Reward = the majority score (signed: -1/0/+1; ``unit``: mapped
to (score + 1) / 2 in [0, 1] for ``process_weighted``). A ``judge_failed`` item, a null score or an unreachable
judge rejects (never a 0). A turn without a next state rejects by default (the judge has nothing to read);
``missing_next_state: zero`` makes it an explicit 0.0. Observations: turn/boolean ``judge_tie`` (count, rate)
and turn/float ``judge_confidence`` (mean, when the judge reports one). The JudgeClient it builds is owned and
closed in ``aclose()``; a ``client=`` passed in is borrowed.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal, Protocol

from engine.records import STATUS_FAILED, STATUS_TIE, JudgeVerdicts
from prm.scorer import BaseScorer, PRMConfigView
from prm.types import Interaction, PRMMetricObservation, PRMScorerResult, RawReward, thaw


class VerdictSource(Protocol):
    """What LLMJudgeScorer asks of a judge client: ``judge_server.client.JudgeClient``, or a user's object with
    the same ``judge`` (sync or async, answering a ``JudgeVerdicts`` or its wire JSON)."""

    def judge(
        self,
        context: list[dict[str, Any]],
        response: dict[str, Any],
        next_state: list[dict[str, Any]],
        tasks: list[str],
        m: int | None = None,
    ) -> Any: ...


class LengthBudgetScorer(BaseScorer):
    """1.0 within the output-token budget, 0.0 above it."""

    name = "length_budget"

    def __init__(self, max_output_tokens: int = 128, weight: float = 1.0, enabled: bool = True):
        super().__init__(weight=weight, enabled=enabled)
        if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int) or max_output_tokens <= 0:
            raise ValueError(f"max_output_tokens must be a positive int, got {max_output_tokens!r}")
        self.max_output_tokens = max_output_tokens

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> float:
        return float(interaction.output_len <= self.max_output_tokens)

    def prepare_result(self, interaction: Interaction, result: RawReward, ctx: Mapping[str, Any]) -> PRMScorerResult:
        iid = interaction.interaction_id
        return PRMScorerResult(
            reward=result,
            observations=(
                PRMMetricObservation("within_budget", "turn", iid, bool(result), "boolean", ("count", "rate")),
                PRMMetricObservation(
                    "output_tokens", "turn", iid, float(interaction.output_len), "float", ("sum", "mean")
                ),
            ),
        )


class JudgeVerdictUnavailable(RuntimeError):
    """The judge answered but produced no usable PRM score for the turn (rejects the trajectory)."""


class LLMJudgeScorer(BaseScorer):
    """Process reward from the Hindsight judge service (majority-vote PRM prompt)."""

    name = "llm_judge"

    def __init__(
        self,
        judge_url: str | None = None,
        api_key: str | None = None,
        m: int | None = None,
        reward_range: Literal["signed", "unit"] = "signed",
        missing_next_state: Literal["reject", "zero"] = "reject",
        timeout_s: float = 120.0,
        deadline_s: float = 300.0,
        client: VerdictSource | None = None,
        weight: float = 1.0,
        enabled: bool = True,
    ):
        super().__init__(weight=weight, enabled=enabled)
        if reward_range not in ("signed", "unit"):
            raise ValueError(f"reward_range must be 'signed' or 'unit', got {reward_range!r}")
        if missing_next_state not in ("reject", "zero"):
            raise ValueError(f"missing_next_state must be 'reject' or 'zero', got {missing_next_state!r}")
        if m is not None and (not isinstance(m, int) or m < 1):
            raise ValueError(f"m must be a positive int, got {m!r}")
        self.m = m
        self.reward_range = reward_range
        self.missing_next_state = missing_next_state
        self._client: VerdictSource
        if client is not None:
            self._client, self._owns_client = client, False
        else:
            if not judge_url:
                raise ValueError("LLMJudgeScorer needs judge_url (or a client)")
            from judge_server.client import (
                JUDGE_RETRY,
                JudgeClient,
            )  # the judge helper's client; imported only when used

            # Bounded per call and in total: the runner adds no timeout of its own.
            self._client = JudgeClient(
                judge_url, api_key=api_key, timeout_s=timeout_s, retry=replace(JUDGE_RETRY, deadline_s=deadline_s)
            )
            self._owns_client = True

    def validate_prm_config(self, config: PRMConfigView, *, training_enabled: bool) -> None:
        if training_enabled and config.advantage_shaping.mode == "process_weighted" and self.reward_range != "unit":
            raise ValueError(
                "llm_judge scores are in [-1, 1]; process_weighted shaping needs kwargs.reward_range: unit"
            )

    async def evaluate_result(self, interaction: Interaction, ctx: Mapping[str, Any]) -> PRMScorerResult | None:
        iid = interaction.interaction_id
        if not interaction.next_state:
            if self.missing_next_state == "zero":
                return PRMScorerResult(reward=0.0)
            raise JudgeVerdictUnavailable(f"turn {iid} has no next state for the judge to read")
        call = self._client.judge(
            thaw(interaction.messages), thaw(interaction.response), thaw(interaction.next_state), ["prm"], m=self.m
        )
        answer = await call if inspect.isawaitable(call) else call
        if isinstance(answer, JudgeVerdicts):  # JudgeClient's record; a user's client may answer the wire JSON
            answer = answer.to_json()
        prm = answer.get("prm") if isinstance(answer, Mapping) else None
        if not isinstance(prm, Mapping):
            raise JudgeVerdictUnavailable(f"judge answer for turn {iid} has no prm verdict")
        status, score = prm.get("status"), prm.get("score")
        if status == STATUS_FAILED or score is None or isinstance(score, bool) or not isinstance(score, int | float):
            raise JudgeVerdictUnavailable(
                f"judge gave no PRM score for turn {iid} (status={status!r}, reason={prm.get('reason')!r})"
            )
        reward = float(score) if self.reward_range == "signed" else (float(score) + 1.0) / 2.0
        observations = [
            PRMMetricObservation("judge_tie", "turn", iid, status == STATUS_TIE, "boolean", ("count", "rate"))
        ]
        confidence = prm.get("confidence")
        if isinstance(confidence, int | float) and not isinstance(confidence, bool):
            observations.append(
                PRMMetricObservation("judge_confidence", "turn", iid, float(confidence), "float", ("mean",))
            )
        return PRMScorerResult(reward=reward, observations=tuple(observations))

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> RawReward | None:
        result = await self.evaluate_result(interaction, ctx)
        return None if result is None else result.reward

    async def aclose(self) -> None:
        if not self._owns_client:
            return
        close = getattr(self._client, "aclose", None) or getattr(self._client, "close", None)
        if close is not None:
            out = close()
            if inspect.isawaitable(out):
                await out
