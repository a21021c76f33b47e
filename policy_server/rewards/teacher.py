"""Hint-augmented teacher prompt and token-exact teacher scoring for on-policy distillation (OPD).

Role: given one recorded turn (request messages + tools + the exact sampled ``response_ids``) and a
hindsight hint accepted by the judge, produce one teacher log-prob per response token.

Contract:

- Teacher prompt = a deep copy of the turn's request messages with the hint appended to the LAST
  ``user`` message, using the template ``prompts/templates/teacher_hint_v1.txt`` loaded with
  ``prompts.load_template`` (placeholders ``${content}`` and ``${hint}``, substituted once by
  ``string.Template``, so ``$`` or braces inside user text are never re-expanded).
  When the context has no user message at all, a new user message holding only the marker + hint is
  appended at the end (the prior system wrote into whatever message came last, e.g. a tool result).
- The prompt is rendered with the POLICY tokenizer's chat template, the turn's ``tools`` and
  ``add_generation_prompt=True`` (``engine.chat.render_prompt_ids``) and the turn's exact
  ``response_ids`` are appended as ids: never a re-tokenized string (a re-tokenized reply can differ from
  the sampled ids, and the log-probs would belong to other tokens).
- Scoring uses the teacher engine's ``score`` (:class:`TeacherEngine`, i.e. ``EngineClient.score``:
  ``max_new_tokens=0``, ``logprob_start_len=len(prompt)-1``): the engine must return exactly
  ``len(response_ids)`` log-probs whose token ids equal the response ids, the first response token
  included. Any mismatch, null or missing value is a :class:`TeacherFailed` with a reason; nothing is
  ever padded (a padded 0.0 means probability 1 and would be a spurious positive OPD advantage).
- Optional top-K (``top_k > 0``) comes from the same single call: ``{"ids": [T][K], "logprobs": [T][K]}``.
"""

from __future__ import annotations

import asyncio
import copy
import string
from dataclasses import dataclass
from typing import Any, Protocol

from engine.chat import normalize_messages, render_prompt_ids
from engine.errors import EngineBadResponse, EngineRejected
from engine.records import PipelineTurn, TeacherTopK
from engine.results import ScoredSequence
from prompts import TemplateError, load_template

TEMPLATE_NAME = "teacher_hint_v1"


@dataclass(frozen=True)
class HintTemplate:
    """The hint-injection template (``${content}``, ``${hint}``) with its version tag ``name@sha256[:12]``."""

    name: str
    text: str
    version: str

    def apply(self, content: str, hint: str) -> str:
        """The user message text with the marker and hint appended (surrounding whitespace stripped)."""
        return string.Template(self.text).substitute(content=content, hint=hint.strip()).strip()


def load_hint_template(name: str = TEMPLATE_NAME) -> HintTemplate:
    """Load ``prompts/templates/<name>.txt`` through the prompts package loader (name + sha256)."""
    tpl = load_template(name)
    if "${hint}" not in tpl.content or "${content}" not in tpl.content:
        raise TemplateError(f"template {name} needs both ${{content}} and ${{hint}} placeholders")
    return HintTemplate(name=name, text=tpl.content, version=tpl.version)


def append_hint(messages: list[dict[str, object]], hint: str, template: HintTemplate) -> list[dict[str, object]]:
    """Messages with ``hint`` appended to the last user message (a new user message if there is none).

    The input is never mutated. Content parts are flattened to text first (normalize_messages), as
    the chat template only renders text.
    """
    out = normalize_messages(copy.deepcopy(messages))
    for msg in reversed(out):
        if msg.get("role") == "user":
            msg["content"] = template.apply(str(msg.get("content") or ""), hint)
            return out
    out.append({"role": "user", "content": template.apply("", hint)})
    return out


def build_teacher_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, object]],
    tools: list[dict[str, object]] | None,
    hint: str,
    template: HintTemplate,
    *,
    chat_template_kwargs: dict[str, object] | None = None,
) -> list[int]:
    """Token ids of the hint-augmented prompt, rendered exactly like a policy prompt (generation prompt on)."""
    return render_prompt_ids(
        tokenizer,
        append_hint(messages, hint, template),
        tools,
        add_generation_prompt=True,
        chat_template_kwargs=chat_template_kwargs,
    )


class TeacherEngine(Protocol):
    """What the scorer needs of the teacher engine (engine.client.EngineClient has it)."""

    async def score(
        self,
        prompt_ids: list[int],
        response_ids: list[int],
        *,
        top_logprobs_num: int = 0,
        temperature: float = 1.0,
        deadline_s: float | None = None,
    ) -> ScoredSequence: ...


class TeacherFailed(Exception):
    """The teacher could not give token-exact log-probs; ``reason`` is the stored reject reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TeacherScores:
    """One teacher log-prob per response id (first included); optional top-K rows ``[T][K]``."""

    prompt_ids: list[int]
    logprobs: list[float]
    topk: TeacherTopK | None
    weight_version: str | None


class TeacherScorer:
    """Scores a turn's exact response ids under the teacher on the hint-augmented prompt.

    One instance per policy server; ``max_concurrency`` bounds in-flight teacher prefills so OPD
    scoring cannot starve the judge engine it usually shares (the teacher is the judge router by default).
    """

    def __init__(
        self,
        client: TeacherEngine,
        tokenizer: Any,
        *,
        top_k: int = 0,
        temperature: float = 1.0,
        max_concurrency: int = 4,
        deadline_s: float | None = None,
        template: HintTemplate | None = None,
    ):
        if top_k < 0:
            raise ValueError("teacher top_k must be >= 0")
        if temperature <= 0:
            raise ValueError("teacher temperature must be > 0 (log-probs of a greedy distribution are undefined)")
        self.client = client
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.temperature = temperature
        self.deadline_s = deadline_s
        self.template = template or load_hint_template()
        self._sem = asyncio.Semaphore(max(1, max_concurrency))

    async def score_turn(self, turn: PipelineTurn, hint: str) -> TeacherScores:
        """Teacher log-probs of ``turn.response_ids`` on the hint-augmented prompt (rendered with the turn's
        own tools and chat-template kwargs); raises TeacherFailed (never pads).

        EngineUnavailable / EngineTimeout (teacher down after the client's retries) are raised as is.
        """
        response_ids = turn.response_ids
        if not response_ids:
            raise TeacherFailed("teacher_bad_input", "turn has no response ids")
        if not hint or not hint.strip():
            raise TeacherFailed("teacher_bad_input", "empty hint")
        prompt_ids = build_teacher_prompt_ids(
            self.tokenizer,
            turn.messages,
            turn.tools,
            hint,
            self.template,
            chat_template_kwargs=turn.chat_template_kwargs,
        )
        try:
            async with self._sem:
                scored = await self.client.score(
                    prompt_ids,
                    response_ids,
                    top_logprobs_num=self.top_k,
                    temperature=self.temperature,
                    deadline_s=self.deadline_s,
                )
        except EngineBadResponse as exc:  # ids differ, nulls, missing rows: the contract is broken
            raise TeacherFailed("teacher_mismatch", exc.message) from exc
        except EngineRejected as exc:  # e.g. prompt longer than the teacher's context
            raise TeacherFailed("teacher_rejected", exc.message) from exc
        # EngineUnavailable / EngineTimeout propagate: an outage is not a verdict on this turn, the
        # dispatcher keeps it pending and retries (docs/REWARD_MODES.md).
        # Belt and braces: EngineClient.score verifies these; a regression there must not reach the trainer.
        if scored.token_ids != response_ids or len(scored.logprobs) != len(response_ids):
            raise TeacherFailed("teacher_mismatch", "scored ids/log-probs do not align with the response ids")
        topk: TeacherTopK | None = None
        if self.top_k:
            ids, lps = scored.top_ids, scored.top_logprobs
            if ids is None or lps is None or len(ids) != len(response_ids) or len(lps) != len(response_ids):
                raise TeacherFailed("teacher_mismatch", "top-k rows missing for some response positions")
            if any(len(r) != self.top_k for r in ids) or any(len(r) != self.top_k for r in lps):
                raise TeacherFailed("teacher_mismatch", f"top-k rows are not all of width {self.top_k}")
            topk = TeacherTopK(ids=ids, logprobs=lps)
        return TeacherScores(
            prompt_ids=prompt_ids, logprobs=list(scored.logprobs), topk=topk, weight_version=scored.weight_version
        )
