"""The judge's votes from any OpenAI-compatible ``/v1/chat/completions`` (``--backend openai``).

Role: the vote source for a judge model served by vLLM, SGLang's OpenAI server, or a hosted API, in place of
SGLang's native ``/generate``. The prompts, voting policies, parsing and verdict shapes are the ``llm``
backend's (judge_server.judge); only the engine call differs. docs/JUDGE_BACKENDS.md is the user guide.

Contract:
- One round of k votes is ONE request with ``n = k`` while the server honours ``n``; a server that rejects
  ``n`` (4xx naming it) or answers fewer choices is remembered as lacking it (``openai_n auto``), and the
  missing votes come from concurrent ``n = 1`` requests. ``openai_n on|off`` fixes the choice.
- Output constraint (``openai_constraint``): ``regex`` (SGLang's extra field), ``structured_outputs``
  (vLLM >= 0.10: ``{"structured_outputs": {"regex": ...}}``), ``guided_regex`` (older vLLM) or ``none``;
  ``auto`` starts with ``regex`` and, when the server refuses that field with a 4xx, goes on unconstrained
  (remembered). A constraint needs ``constrain_output`` (the template's regex).
- A vote that does not parse is re-asked (the vote's answer plus a short correction, prompts/templates
  ``judge_reask_<task>_v1``) at most ``openai_reask_max`` times; still unparseable, it is a missing vote,
  as with the ``llm`` backend (never a default score).
- Retries, timeouts and the deadline are the one client layer's (engine.client.EngineClient.chat over
  engine.http_client): every call gets what is left of the judge request's deadline.
- Cost: every HTTP request counts one ``engine_calls``; ``prompt_tokens`` / ``completion_tokens`` from its
  ``usage``, ``cached_tokens`` from ``usage.prompt_tokens_details.cached_tokens`` (0 when absent).
- Not available here: token-level prompt log-probs. The OPD teacher needs SGLang's ``/generate`` (or vLLM's
  ``prompt_logprobs``) and keeps its own ``--teacher-url``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from engine.client import EngineClient
from engine.errors import EngineBadResponse, EngineRejected, EngineTimeout
from engine.records import JudgeUsage
from judge_server.voting import Vote
from prompts import load_template, parse_hint, parse_verdict

logger = logging.getLogger(__name__)

CONSTRAINT_FIELDS = ("regex", "structured_outputs", "guided_regex")


class OpenAIVotes:
    """Votes of one judge model behind an OpenAI-compatible chat endpoint (see the module docstring); each
    call's cost is added to the task's :class:`~engine.records.JudgeUsage`."""

    def __init__(
        self,
        client: EngineClient,
        *,
        model: str,
        temperature: float,
        top_p: float,
        max_tokens: int,
        n_mode: str = "auto",
        constraint: str = "auto",
        reask_max: int = 1,
        seed: int | None = None,
        allowed: dict[str, frozenset[int]],
    ):
        self.client = client
        self.model = model
        self.temperature, self.top_p, self.max_tokens, self.seed = temperature, top_p, max_tokens, seed
        self.n_mode = n_mode
        self.supports_n: bool | None = {"auto": None, "on": True, "off": False}[n_mode]
        self.constraint: str | None = (
            "regex" if constraint == "auto" else (None if constraint == "none" else constraint)
        )
        self.constraint_auto = constraint == "auto"
        self.reask_max = reask_max
        self.allowed = allowed
        self.reask = {task: load_template(f"judge_reask_{task}_v1").content.strip() for task in allowed}

    async def sample(
        self,
        task: str,
        messages: list[dict[str, str]],
        k: int,
        round_index: int,
        remaining_s: Callable[[], float],
        usage: JudgeUsage,
        regex: str | None,
    ) -> list[Vote]:
        """k votes for ``task`` on the rendered judge ``messages``; ``remaining_s()`` is the deadline left."""
        texts: list[str] = []
        if k > 1 and self.supports_n is not False:
            texts = await self._call(messages, k, round_index, remaining_s, usage, regex)
            if len(texts) > k or (len(texts) < k and self.n_mode == "on"):
                raise EngineBadResponse(f"asked for n={k} choices, got {len(texts)}", url=self.client.base_url)
            if len(texts) < k:  # happens once: later rounds go straight to concurrent calls
                logger.info("judge endpoint answered %d of n=%d choices: using concurrent calls", len(texts), k)
                self.supports_n = False
            else:
                self.supports_n = True
        missing = k - len(texts)
        if missing:
            more = await asyncio.gather(
                *(self._call(messages, 1, round_index * 1000 + i, remaining_s, usage, regex) for i in range(missing))
            )
            texts += [t[0] for t in more]
        return list(
            await asyncio.gather(
                *(self._vote(task, messages, t, round_index, remaining_s, usage, regex) for t in texts)
            )
        )

    async def _vote(
        self,
        task: str,
        messages: list[dict[str, str]],
        text: str,
        round_index: int,
        remaining_s: Callable[[], float],
        usage: JudgeUsage,
        regex: str | None,
    ) -> Vote:
        value = parse_verdict(text, self.allowed[task])
        for _ in range(self.reask_max):
            if value is not None:
                break
            follow_up = [
                *messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": self.reask[task]},
            ]
            [text] = await self._call(follow_up, 1, round_index, remaining_s, usage, regex)
            value = parse_verdict(text, self.allowed[task])
        return Vote(value=value, hint=parse_hint(text) if task == "hint" else None, text=text)

    def body(self, messages: list[dict[str, str]], n: int, seed_offset: int, regex: str | None) -> dict[str, Any]:
        """The chat request of one call: ``n`` only when > 1, the constraint in the form the server takes."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "stream": False,
        }
        if n > 1:
            body["n"] = n
        if self.seed is not None:
            body["seed"] = self.seed + seed_offset
        if regex and self.constraint == "regex":
            body["regex"] = regex
        elif regex and self.constraint == "structured_outputs":
            body["structured_outputs"] = {"regex": regex}
        elif regex and self.constraint == "guided_regex":
            body["guided_regex"] = regex
        return body

    async def _call(
        self,
        messages: list[dict[str, str]],
        n: int,
        seed_offset: int,
        remaining_s: Callable[[], float],
        usage: JudgeUsage,
        regex: str | None,
    ) -> list[str]:
        while True:
            left = remaining_s()
            if left <= 0:
                raise EngineTimeout("judge request deadline passed before the call", url=self.client.base_url)
            body = self.body(messages, n, seed_offset, regex)
            try:
                raw = await self.client.chat(body, deadline_s=left)
            except EngineRejected as exc:
                # Capability discovery: a server that refuses the constraint field (or n) is asked again
                # without it, once; the choice is remembered for every later call.
                sent = next((f for f in CONSTRAINT_FIELDS if f in body), None)
                if sent and self.constraint_auto and _names(exc, sent):
                    logger.warning("judge endpoint refused %r (%s): judging unconstrained, with re-asks", sent, exc)
                    self.constraint = None
                    continue
                if n > 1 and self.supports_n is None and _names(exc, "n"):
                    self.supports_n = False
                    return []
                raise
            return self._texts(raw, usage)

    def _texts(self, raw: Any, usage: JudgeUsage) -> list[str]:
        if not isinstance(raw, dict) or not isinstance(raw.get("choices"), list):
            raise EngineBadResponse("chat completion without a choices list", url=self.client.base_url)
        used: dict[str, Any] = raw["usage"] if isinstance(raw.get("usage"), dict) else {}
        details: dict[str, Any] = used.get("prompt_tokens_details") or {}
        if not isinstance(details, dict):
            details = {}
        usage.engine_calls += 1
        usage.prompt_tokens += int(used.get("prompt_tokens") or 0)
        usage.cached_tokens += int(details.get("cached_tokens") or 0)
        usage.completion_tokens += int(used.get("completion_tokens") or 0)
        texts = []
        for choice in raw["choices"]:
            message = choice.get("message") if isinstance(choice, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            texts.append(content if isinstance(content, str) else "")
        return texts


def _names(exc: EngineRejected, field: str) -> bool:
    """Whether a 4xx's message names ``field`` (how servers say an unknown or unsupported parameter)."""
    message = str(exc).lower()
    return (
        f"'{field}'" in message or f'"{field}"' in message or f" {field} " in f" {message} " or f"{field}:" in message
    )
