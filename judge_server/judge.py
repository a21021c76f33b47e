"""The judge core: render prompt -> one engine call per voting round (n votes) -> parse -> vote -> result.

Contract (docs/CONTRACTS.md "Judge service"):
- Backends: ``llm`` (below: SGLang's ``/generate``), ``openai`` (the same prompts as chat messages to any
  OpenAI-compatible ``/v1/chat/completions``: judge_server.openai_backend), ``rules`` (judge_server.rules).
- Each requested task (``prm``, ``hint``) of one item runs concurrently; each voting round of a task is
  ONE ``POST /generate`` with ``sampling_params.n = k`` (SGLang prefills the prompt once for all k samples).
- Prompt: the task's template (prompts/templates) rendered to chat messages, then to ``input_ids`` with the
  judge tokenizer's chat template (engine.chat.render_prompt_ids). The tokenizer is ``tokenizer_path`` or,
  when unset, the engine's ``model_info.tokenizer_path`` if that is a local directory. Without one the
  engine gets ``text`` (sections labelled, prompts.render_plain_text) and context is counted as chars/4.
- Sampling: temperature, top_p, max_new_tokens, optional sampling_seed (+ round index), and, with
  ``constrain_output``, the template's regex (PRM: bounded free reasoning then the box; hint: the decision
  and, for 1, a marker-delimited hint of 11..hint_max_chars characters) so every vote parses.
- Guards (judge_server.guards, configured by ``guards``): pure rules run on every request beside the votes,
  whatever the backend and tasks; the answer lists the hits (``guards``) and each task's verdict is shaped
  by them (judge_server.guard_verdicts); ``prompt_versions.guards`` names the rule set and configuration.
- Limits: a global semaphore bounds concurrent engine calls; each item has a deadline
  (``request_deadline_s``) that covers queueing, retries and all rounds.
- Failures: engine errors are retried by EngineClient within the remaining deadline; when they persist
  (or the deadline passes) the task's status is ``judge_failed`` with ``score: null`` and a reason, the
  votes of finished rounds kept. The HTTP answer stays 200: the status is per task (and per batch item).
- One prefill per turn: the templates put everything about the turn first and the task's question last,
  so the PRM and hint prompts of one item share a long prefix. With both tasks requested (and
  ``prefill_shared_prefix``), one ``/generate`` of that common prefix with ``max_new_tokens=0`` runs before
  the tasks, so the engine's prefix cache (SGLang's radix cache, the dev engine's prefix cache) holds it and
  both tasks prefill only their own tail. It is an optimisation: its failure is logged and the tasks run.
- Cost (per task, and the totals in ``usage``): ``engine_calls``; ``prompt_tokens`` counts each call's
  prompt once (n samples share one prefill); ``cached_tokens`` the engine's ``meta_info.cached_tokens`` of
  each call (first sample; 0 when missing); ``completion_tokens`` sums all samples. The shared-prefix call
  is counted in the first requested task. ``prompt_tokens - cached_tokens`` is what was prefilled.
- Request ids and aborts (a caller that hangs up stops its engine work; engine.disconnect): with a
  ``rid_prefix`` (``hj-<32 hex>-``, made per HTTP request by routes.py; ``hj-<hex>-<item>-`` per batch
  item) every engine call carries ``rid = <prefix><task>-<round>``, so one ``/abort_request`` with the
  prefix (:meth:`JudgeService.abort`) hits every round of the request and nothing else. The abort goes to
  ``engine_url``: an engine takes it; sglang-router 0.3.2 does not fan ``/abort_request`` out and answers
  404, which is logged and ignored (best effort). Cancelling the rounds also closes their connections,
  which SGLang itself notices (it polls for disconnects of waiting ``/generate`` requests), so through a
  router the rounds still stop, only later; operators who need the immediate abort point the judge at an
  engine worker URL. Known limit: with ``n > 1`` real SGLang gives each parallel sample a fresh rid
  (SGLang assigns them), so the prefix abort can miss those samples there; the connection close still ends them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine.chat import render_prompt_ids
from engine.client import EngineClient, parse_generation
from engine.disconnect import abort_engine_requests
from engine.errors import EngineBadResponse, EngineError, EngineTimeout
from engine.records import STATUS_FAILED, STATUS_OK, GuardHit, HintVerdict, JudgeUsage, JudgeVerdicts, PrmVerdict
from judge_server.errors import InvalidRequest
from judge_server.guard_verdicts import guarded_hint, guarded_prm, step_of
from judge_server.guards import Guards, guards_version
from judge_server.metrics import JudgeMetrics
from judge_server.openai_backend import OpenAIVotes
from judge_server.rules import RuleJudge
from judge_server.schemas import JudgeRequest
from judge_server.settings import JudgeSettings
from judge_server.vote_model import AgreementTracker
from judge_server.voting import Vote, VoteResult, run_policy, select_hint
from prompts import (
    TokenCounter,
    load_regex,
    load_template,
    parse_hint,
    parse_verdict,
    render_judge_messages,
    render_plain_text,
)

logger = logging.getLogger(__name__)

ALLOWED = {"prm": frozenset({1, 0, -1}), "hint": frozenset({1, -1})}


def tracker_for(s: JudgeSettings, k_outcomes: int) -> AgreementTracker:
    return AgreementTracker(
        k_outcomes,
        default_agreement=s.default_agreement,
        default_unparseable=s.default_unparseable,
        prior_turns=s.agreement_prior_turns,
        window_turns=s.agreement_window_turns,
    )


def count_call(usage: JudgeUsage, gen: Any, prompt_len: int) -> None:
    """Add to ``usage`` one engine call whose first sample is ``gen`` (prompt and cache counted once per call)."""
    usage.engine_calls += 1
    usage.prompt_tokens += int(gen.prompt_tokens) if gen.prompt_tokens is not None else prompt_len
    usage.cached_tokens += int(gen.meta_info.get("cached_tokens") or 0)


def total_usage(parts: list[JudgeUsage]) -> JudgeUsage:
    """The summed cost of a request's tasks (the answer's ``usage``)."""
    return JudgeUsage(**{name: sum(getattr(u, name) for u in parts) for name in JudgeUsage.model_fields})


class JudgeService:
    """Judges items with the configured backend (``llm``: the engine; ``rules``: RuleJudge)."""

    def __init__(
        self,
        settings: JudgeSettings,
        metrics: JudgeMetrics,
        *,
        client: EngineClient | None = None,
        tokenizer: Any = None,
    ):
        self.settings = settings
        self.metrics = metrics
        # per-task vote-noise estimate of this instance, for the sequential error-budget rule (bounded window)
        self.trackers = {task: tracker_for(settings, len(values)) for task, values in ALLOWED.items()}
        self.client = client
        self.tokenizer = tokenizer
        self.counter = TokenCounter.from_tokenizer(tokenizer) if tokenizer is not None else TokenCounter.estimate()
        self.semaphore = asyncio.Semaphore(settings.max_concurrent_engine_calls)
        self.rules = RuleJudge(settings.rules_positive, settings.rules_negative)
        self.guards = Guards(settings.guards)
        self.guards_version = guards_version(settings.guards)
        self.templates = {
            "prm": load_template(settings.prm_template, settings.templates_dir),
            "hint": load_template(settings.hint_template, settings.templates_dir),
        }
        self.regex: dict[str, str | None] = dict.fromkeys(self.templates)
        if settings.constrain_output:
            for task, tpl in self.templates.items():
                self.regex[task] = load_regex(
                    tpl.name,
                    settings.templates_dir,
                    reasoning_max_chars=settings.reasoning_max_chars,
                    hint_max_chars=settings.hint_max_chars,
                )
        if settings.backend in ("llm", "openai") and client is None:
            raise ValueError(f"backend {settings.backend!r} needs an EngineClient")
        self.openai: OpenAIVotes | None = None
        if settings.backend == "openai":
            assert client is not None and settings.model
            self.openai = OpenAIVotes(
                client,
                model=settings.model,
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=settings.max_new_tokens,
                n_mode=settings.openai_n,
                constraint=settings.openai_constraint,
                reask_max=settings.openai_reask_max,
                seed=settings.sampling_seed,
                allowed=ALLOWED,
            )

    @property
    def prompt_versions(self) -> dict[str, str]:
        """Each task's template version, and ``guards``: the guard rules and configuration behind every verdict."""
        if self.settings.backend == "rules":
            versions = dict.fromkeys(self.templates, self.rules.version)
        else:
            versions = {task: tpl.version for task, tpl in self.templates.items()}
        return {**versions, "guards": self.guards_version}

    # ------------------------------------------------------------------ one item
    async def abort(self, rid_prefix: str) -> bool:
        """Best-effort ``/abort_request`` of every engine call under ``rid_prefix``; never raises."""
        if self.client is None:
            return False
        return await abort_engine_requests([self.client], rid_prefix) == 1

    async def judge(self, req: JudgeRequest, rid_prefix: str | None = None) -> JudgeVerdicts:
        """The verdicts of ``req``'s tasks (only those: an unrequested task stays absent on the wire), every
        guard that fired, the summed cost and the template versions."""
        m = req.m or self.settings.m
        if m > self.settings.max_m:
            raise InvalidRequest(f"m={m} exceeds the maximum of {self.settings.max_m}")
        policy = req.policy or self.settings.policy
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_deadline_s
        usages = {t: JudgeUsage() for t in req.tasks}
        # The guards are pure and cheap: they run on every request, beside the votes, whatever the tasks.
        hits = self.guards.run(step_of(req))
        for hit in hits:
            self.metrics.guard_hits.labels(rule=hit.rule, action=hit.action).inc()
        prompts = self.engine_prompts(req) if self.settings.backend != "rules" else {}
        # The shared-prefix prefill is /generate's; an OpenAI endpoint caches prefixes on its own (if at all).
        if len(prompts) > 1 and self.settings.prefill_shared_prefix and self.settings.backend == "llm":
            await self._prefill_shared_prefix(list(prompts.values()), deadline, usages[req.tasks[0]], rid_prefix)
        results = await asyncio.gather(
            *(
                self._run_task(t, req, prompts.get(t), m, policy, deadline, usages[t], hits, rid_prefix)
                for t in req.tasks
            )
        )
        versions = self.prompt_versions
        # Only the requested tasks are set: an unrequested one stays absent from the answer, never null.
        return JudgeVerdicts.model_validate(
            {
                **dict(zip(req.tasks, results, strict=True)),
                "guards": hits,
                "usage": total_usage(list(usages.values())),
                "prompt_versions": {**{t: versions[t] for t in req.tasks}, "guards": versions["guards"]},
            }
        )

    async def _run_task(
        self,
        task: str,
        req: JudgeRequest,
        prompt: dict[str, Any] | None,
        m: int,
        policy: str,
        deadline: float,
        usage: JudgeUsage,
        hits: list[GuardHit],
        rid_prefix: str | None = None,
    ) -> PrmVerdict | HintVerdict:
        collected: list[Vote] = []
        s = self.settings
        try:
            sampler = self._sampler(task, req, prompt, deadline, usage, rid_prefix)
            async with asyncio.timeout_at(deadline):
                result = await run_policy(
                    sampler,
                    policy=policy,
                    m=m,
                    m_max=max(s.m_max, m),
                    min_valid=s.min_valid,
                    escalate_step=s.escalate_step,
                    collected=collected,
                    outcomes=sorted(ALLOWED[task]),
                    stop_change_prob=s.stop_change_prob,
                    stop_prior=s.stop_prior,
                    first_round=s.sequential_first_round,
                    stop_rule=s.sequential_stop_rule,
                    tracker=self.trackers[task],
                    error_budget_share=s.error_budget_share,
                )
        except (EngineError, TimeoutError) as exc:
            reason = (
                str(exc)
                if isinstance(exc, EngineError)
                else (f"deadline of {self.settings.request_deadline_s:.1f}s exceeded")
            )
            self.metrics.engine_errors.labels(kind=type(exc).__name__).inc()
            logger.warning("judge task %s failed: %s", task, reason)
            result = VoteResult(
                score=None,
                status=STATUS_FAILED,
                votes=[s.value for s in collected],
                confidence=0.0,
                reason=reason,
                samples=collected,
            )
        voted = self._task_json(task, result, usage)
        verdict = guarded_prm(voted, hits) if isinstance(voted, PrmVerdict) else guarded_hint(voted, hits)
        self._observe(task, result, verdict.status, usage)
        return verdict

    def _observe(self, task: str, result: VoteResult, status: str, usage: JudgeUsage) -> None:
        """``status``: the task's final one (after the guards); the vote figures are the votes' own."""
        self.metrics.verdicts.labels(task=task, status=status).inc()
        self.metrics.votes_per_turn.labels(task=task).observe(len(result.votes))
        for kind, tokens in (
            ("prompt", usage.prompt_tokens),
            ("cached", usage.cached_tokens),
            ("completion", usage.completion_tokens),
        ):
            self.metrics.tokens_per_turn.labels(task=task, kind=kind).observe(tokens)
            self.metrics.tokens_total.labels(task=task, kind=kind).inc(tokens)
        misses = sum(v is None for v in result.votes)
        if misses and result.status != STATUS_FAILED:
            self.metrics.parse_failures.labels(task=task).inc(misses)

    def _task_json(self, task: str, result: VoteResult, usage: JudgeUsage) -> PrmVerdict | HintVerdict:
        """The task's verdict (engine.records), its cost fields after the vote fields."""
        if task == "prm":
            return PrmVerdict.wire(
                score=result.score,
                status=result.status,
                votes=result.votes,
                confidence=round(result.confidence, 6),
                reason=result.reason,
                usage=usage,
            )
        failed = result.status == STATUS_FAILED
        hint = None
        if not failed:  # a failed round has no votes to select a hint from
            hint = select_hint(
                result.samples,
                result,
                min_chars=self.settings.hint_min_chars,
                require_majority=self.settings.hint_require_majority,
            )
        return HintVerdict.wire(
            accepted=hint is not None,
            hint=hint,
            votes=result.votes,
            status=STATUS_FAILED if failed else STATUS_OK,
            reason=result.reason,
            vote_status=result.status,
            usage=usage,
        )

    # ------------------------------------------------------------------ vote sources
    def engine_prompts(self, req: JudgeRequest) -> dict[str, dict[str, Any]]:
        """Each requested task's engine prompt: ``{"input_ids": [...]}``, or ``{"text": ...}`` without a tokenizer."""
        context = [m.model_dump(exclude_none=True) for m in req.context]
        response = req.response.model_dump(exclude_none=True)
        next_state = [m.model_dump(exclude_none=True) for m in req.next_state]
        prompts: dict[str, dict[str, Any]] = {}
        for task in req.tasks:
            messages, _info = render_judge_messages(
                self.templates[task],
                context=context,
                response=response,
                next_state=next_state,
                counter=self.counter,
                context_budget_tokens=self.settings.context_budget_tokens,
                part_budget_tokens=self.settings.part_budget_tokens,
                include_reasoning=self.settings.include_reasoning,
            )
            if self.settings.backend == "openai":
                prompts[task] = {"messages": messages}  # the endpoint applies its own chat template
            elif self.tokenizer is not None:
                prompts[task] = {"input_ids": render_prompt_ids(self.tokenizer, messages)}
            else:
                prompts[task] = {"text": render_plain_text(messages)}
        return prompts

    async def _prefill_shared_prefix(
        self, prompts: list[dict[str, Any]], deadline: float, usage: JudgeUsage, rid_prefix: str | None
    ) -> None:
        """Prefill the prompts' common prefix once (max_new_tokens=0) so every task's call reuses it."""
        assert self.client is not None
        key = "input_ids" if "input_ids" in prompts[0] else "text"
        prefix = os.path.commonprefix([p[key] for p in prompts])
        size = len(prefix) if key == "input_ids" else self.counter.count(prefix)
        if size < self.settings.shared_prefix_min_tokens:
            return
        payload: dict[str, Any] = {key: prefix, "sampling_params": {"max_new_tokens": 0}, "stream": False}
        if rid_prefix:
            payload["rid"] = f"{rid_prefix}prefix"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline), self.semaphore:
                raw = await self.client.generate(payload, deadline_s=max(0.001, deadline - loop.time()))
            item = raw[0] if isinstance(raw, list) else raw
            count_call(usage, parse_generation(item, return_logprob=False, url=self.client.base_url), size)
        except (EngineError, TimeoutError) as exc:  # the tasks still run (and fail on their own if they must)
            logger.warning("shared-prefix prefill failed: %s", exc)

    def _sampler(
        self,
        task: str,
        req: JudgeRequest,
        prompt: dict[str, Any] | None,
        deadline: float,
        usage: JudgeUsage,
        rid_prefix: str | None = None,
    ) -> Callable[[int, int], Awaitable[list[Vote]]]:
        if self.settings.backend == "rules":
            next_state = [m.model_dump(exclude_none=True) for m in req.next_state]
            vote = self.rules.prm_vote(next_state) if task == "prm" else self.rules.hint_vote(next_state)

            async def rule_sample(k: int, round_index: int) -> list[Vote]:
                return [Vote(vote.value, vote.hint, vote.text) for _ in range(k)]

            return rule_sample
        assert prompt is not None
        if self.openai is not None:
            votes_source = self.openai

            async def chat_sample(k: int, round_index: int) -> list[Vote]:
                loop = asyncio.get_running_loop()
                async with self.semaphore:
                    started = time.perf_counter()
                    votes = await votes_source.sample(
                        task,
                        prompt["messages"],
                        k,
                        round_index,
                        lambda: deadline - loop.time(),
                        usage,
                        self.regex.get(task),
                    )
                    self.metrics.engine_latency.labels(task=task).observe(time.perf_counter() - started)
                self.metrics.engine_calls.labels(task=task).inc()
                return votes

            return chat_sample

        async def engine_sample(k: int, round_index: int) -> list[Vote]:
            rid = f"{rid_prefix}{task}-{round_index}" if rid_prefix else None
            return await self._engine_call(task, prompt, k, round_index, deadline, usage, rid)

        return engine_sample

    def sampling_params(self, task: str, k: int, round_index: int) -> dict[str, Any]:
        s = self.settings
        sp: dict[str, Any] = {
            "n": k,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens,
        }
        if s.sampling_seed is not None:
            sp["sampling_seed"] = s.sampling_seed + round_index
        if self.regex.get(task):
            sp["regex"] = self.regex[task]
        return sp

    async def _engine_call(
        self,
        task: str,
        prompt: dict[str, Any],
        k: int,
        round_index: int,
        deadline: float,
        usage: JudgeUsage,
        rid: str | None = None,
    ) -> list[Vote]:
        assert self.client is not None
        payload = {**prompt, "sampling_params": self.sampling_params(task, k, round_index), "stream": False}
        if rid:
            payload["rid"] = rid
        loop = asyncio.get_running_loop()
        async with self.semaphore:
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise EngineTimeout("request deadline passed while waiting for an engine slot")
            started = time.perf_counter()
            raw = await self.client.generate(payload, deadline_s=remaining_s)
            self.metrics.engine_latency.labels(task=task).observe(time.perf_counter() - started)
        self.metrics.engine_calls.labels(task=task).inc()
        items = raw if isinstance(raw, list) else [raw]
        if len(items) != k:
            raise EngineBadResponse(f"asked for n={k} samples, engine returned {len(items)}", url=self.client.base_url)
        gens = [parse_generation(item, return_logprob=False, url=self.client.base_url) for item in items]
        count_call(usage, gens[0], len(prompt.get("input_ids", [])))
        usage.completion_tokens += sum(len(g.output_ids) for g in gens)
        allowed = ALLOWED[task]
        votes = []
        for g in gens:
            value = parse_verdict(g.text, allowed)
            votes.append(Vote(value=value, hint=parse_hint(g.text) if task == "hint" else None, text=g.text))
        return votes
