"""Token-exact generation: render -> /generate (ids, log-probs) -> parse, with pause-resume and streaming.

Role: the only path from a chat request to the policy engine. Contract:

- The prompt is rendered by ``engine.continuation.ContinuationRenderer`` with the policy tokenizer: a
  request that extends a recorded turn continues that turn's exact prompt and sampled ids (only the new
  messages are rendered), any other gets the template's full render (``engine.chat.render_prompt_ids``).
  It goes to the engine's ``/generate`` as ``input_ids`` with ``return_logprob`` through
  ``engine.client.EngineClient`` (``stream_generate`` for streaming). The result keeps exactly the
  sampled ids (stop token included) and one rollout log-prob each; the text is only for the client.
- Every engine submission first passes the weight gate (policy_server.serving.weight_sync): during a weight
  update new submissions wait (bounded) instead of failing.
- A generation that comes back aborted (``finish_reason.type == "abort"``, HTTP 200 with the partial
  output: SGLang's ``pause_generation`` mode ``abort``) is resubmitted with ``prompt + ids so far`` and
  ``max_new_tokens`` reduced by what was produced; ids and log-probs are concatenated. Each segment's
  ``weight_version`` is kept: ``weight_versions`` lists every version that produced tokens (in order),
  and ``weight_version`` is the first (the oldest, the conservative one for staleness). With a holding
  pause mode (retract/in_place) a request in flight across an update also lists the version it started on.
  A generation that sampled nothing takes the version the engine reported, else the weight gate's. Streaming
  and non-streaming requests share this one loop (``Generator._segments``); only the submission differs.
- At most ``max_resumes`` resubmissions; then the request fails with 503 (never loops forever).

Request ids and client disconnects (a client that hangs up stops its engine work; engine.disconnect).
Every engine submission carries a unique ``rid``: ``GenResult.rid_prefix`` (``hs-<32 hex>-``,
one per chat request, the hex of its ``chatcmpl-`` id) plus the segment number (``hs-<hex>-0``, ``-1`` for
the first resume, ...). The prefix is fixed-length and server-generated (never the client's X-Request-ID,
which may repeat), and ends with ``-``, so SGLang's prefix matching in ``/abort_request`` hits every
segment of this request and nothing else. When the client goes away the route marks the result
``abandoned``, stops reading and calls :func:`engine.disconnect.abort_engine_requests` (best effort, ``ABORT_TIMEOUT_S``
per worker, logged, never raised) on every engine WORKER URL: sglang-router 0.3.2 does not fan
``/abort_request`` out. An abandoned result is never resumed: an abort that comes back for it is our own
(or arrives after the client left) and raises :class:`GenerationAbandoned` instead of resubmitting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.chat_families import DEFAULT_FAMILY, ChatFamily
from engine.client import EngineClient
from engine.continuation import ContinuationRenderer, PriorTurn, Rendered
from engine.errors import EngineBadResponse
from engine.tool_parsers import reasoning_parser, tool_call_parser
from policy_server.errors import InvalidRequest, ServiceUnavailable
from policy_server.serving.prompt_size import longest_token_chars, prompt_chars, prompt_token_floor
from policy_server.serving.weight_sync import WeightGate

logger = logging.getLogger(__name__)

# Below this many characters of message text (+ tool schemas) a prompt is rendered on the event loop.
INLINE_RENDER_MAX_CHARS = 2048
# Renders running in worker threads at once: more would only queue for the GIL and hold their memory at once.
DEFAULT_RENDER_CONCURRENCY = 2


def max_new_tokens(sp: dict[str, object]) -> int:
    """The sampling params' token budget: always set, as an int, by the request's validation (an engine call
    without one is a bug, never a request to fix)."""
    n = sp.get("max_new_tokens")
    if not isinstance(n, int):
        raise TypeError(f"sampling params without an integer max_new_tokens: {n!r}")
    return n


class GenerationAbandoned(Exception):
    """The client of this generation is gone: it is stopped, never resumed, and nothing of it is recorded."""


@dataclass
class GenResult:
    """What was sampled for one request, token-exact, and the engine rids it used."""

    prompt_ids: list[int]
    rid_prefix: str = ""  # "hs-<hex>-"; empty: the engine picks its own rids (nothing can be aborted)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: dict[str, object] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)
    resumes: int = 0
    segments: int = 0  # engine submissions so far (the next rid's suffix)
    abandoned: bool = False  # the client left: stop, never resume
    top_logprobs_num: int = 0  # the client's top_logprobs: the engine reports that many alternatives per token
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # [len(response_ids)][K]
    cached_tokens: int | None = None  # the first submission's meta_info.cached_tokens (engine prefix-cache hit)
    engine: EngineClient | None = None  # the engine its session is pinned to (a canary); None: the generator's

    def input_ids(self) -> list[int]:
        """The next engine submission's input: the prompt, then what was sampled so far (the prompt list itself
        before anything was: a 30k-token prompt is not copied for the first submission)."""
        return self.prompt_ids + self.response_ids if self.response_ids else self.prompt_ids

    def next_rid(self) -> str | None:
        """The rid of the next engine submission (one per segment, so a resume never reuses an rid)."""
        if self.abandoned:
            raise GenerationAbandoned(f"client gone; not submitting {self.rid_prefix or 'the request'} again")
        rid = f"{self.rid_prefix}{self.segments}" if self.rid_prefix else None
        self.segments += 1
        return rid

    @property
    def weight_version(self) -> str | None:
        return self.weight_versions[0] if self.weight_versions else None

    def add_version(self, version: str | None) -> None:
        if version is not None and version not in self.weight_versions:
            self.weight_versions.append(version)


@dataclass
class _Segment:
    """How one engine submission ended: its finish reason and the weight version the engine reported."""

    finish: dict[str, object] = field(default_factory=dict)
    weight_version: str | None = None


# Sends one segment (its sampling params) for a result, filling the result and the segment; yields text deltas.
Submit = Callable[[dict[str, object], GenResult, _Segment], AsyncGenerator[str, None]]


class Generator:
    """Renders prompts and drives the engine; one instance per server."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        gate: WeightGate,
        *,
        max_resumes: int = 8,
        deadline_s: float | None = None,
        max_prompt_tokens: int | None = None,
        render_verify_tokens_per_turn: int = 2048,
        render_concurrency: int = DEFAULT_RENDER_CONCURRENCY,
        history: str = "sampled",
        family: ChatFamily = DEFAULT_FAMILY,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.gate = gate
        self.max_resumes = max_resumes
        self.deadline_s = deadline_s
        self.max_prompt_tokens = max_prompt_tokens
        self._max_token_chars = longest_token_chars(tokenizer) if max_prompt_tokens else 1
        self.renderer = ContinuationRenderer(
            tokenizer, verify_tokens_per_turn=render_verify_tokens_per_turn, history=history
        )
        self.family = family  # the template's tool-call/reasoning markup and tool-call id form
        self.tool_parser = tool_call_parser(family.tool_call_parser, family.id_form)
        self.reasoning_parser = reasoning_parser(family.reasoning_parser)
        # Bounds the renders in worker threads (each holds its prompt's text and ids while it runs); the
        # rest wait here, on the event loop, without holding a thread or memory.
        self._render_slots = asyncio.Semaphore(render_concurrency)

    def _too_long(self, tokens: int, exact: bool) -> InvalidRequest:
        what = f"{tokens} tokens" if exact else f"at least {tokens} tokens"
        return InvalidRequest(
            f"the prompt has {what}; the engine's context is {self.max_prompt_tokens} tokens",
            param="messages",
            code="context_length_exceeded",
        )

    def check_fits(self, messages: list[dict[str, object]], tools: Sequence[object] | None = None) -> None:
        """400 ``context_length_exceeded`` before any rendering when the prompt (its messages and its tools)
        cannot fit the engine's context: a multi-megabyte history or tool description would otherwise be
        rendered and tokenized (seconds of CPU, gigabytes) only for the engine to refuse it. The cheap
        bound; :meth:`render` checks the exact count after rendering."""
        if self.max_prompt_tokens is None:
            return
        floor = prompt_token_floor(messages, self._max_token_chars, tools)
        if floor >= self.max_prompt_tokens:
            raise self._too_long(floor, exact=False)

    async def render(
        self,
        messages: list[dict[str, object]],
        tools: list[dict[str, object]] | None,
        chat_template_kwargs: dict[str, object] | None = None,
        prior: PriorTurn | None = None,
    ) -> Rendered:
        """The prompt (engine.continuation): a continuation of ``prior`` when the template allows, else a full
        render; checked against the context, the cheap bound first (:meth:`check_fits`), then the exact count,
        so a prompt that cannot fit is a 400 before the engine sees it.

        Template rendering + tokenization is CPU work: a continued turn's is proportional to its new messages,
        a full render's to the whole history. A short prompt renders in ~0.1 ms, less than a thread hand-off
        costs, so it runs inline, as does a continuation with short new messages and no check due
        (``ContinuationRenderer.continues_cheaply``); a long one runs in a worker thread (at most
        ``render_concurrency`` at once), because even with a prior turn the renderer may fall back to the full render, which would stall the
        other requests on the loop."""
        self.check_fits(messages, tools)
        if prompt_chars(messages, tools, INLINE_RENDER_MAX_CHARS) <= INLINE_RENDER_MAX_CHARS or self._continues_cheaply(
            messages, tools, chat_template_kwargs, prior
        ):
            rendered = self.renderer.render(messages, tools, chat_template_kwargs, prior)
        else:
            async with self._render_slots:
                rendered = await asyncio.to_thread(self.renderer.render, messages, tools, chat_template_kwargs, prior)
        if self.max_prompt_tokens is not None and len(rendered.ids) >= self.max_prompt_tokens:
            raise self._too_long(len(rendered.ids), exact=True)
        return rendered

    def _continues_cheaply(
        self,
        messages: list[dict[str, object]],
        tools: list[dict[str, object]] | None,
        chat_template_kwargs: dict[str, object] | None,
        prior: PriorTurn | None,
    ) -> bool:
        """A continuation whose new messages are short renders only those: inline, like a short prompt (a
        thread hand-off would cost more than the render)."""
        if prior is None or len(messages) <= len(prior.messages):
            return False
        if prompt_chars(messages[len(prior.messages) :], None, INLINE_RENDER_MAX_CHARS) > INLINE_RENDER_MAX_CHARS:
            return False
        return self.renderer.continues_cheaply(messages, tools, chat_template_kwargs, prior)

    def _segment_params(self, sp: dict[str, object], produced: int) -> dict[str, object]:
        out = dict(sp)
        out["max_new_tokens"] = max_new_tokens(sp) - produced
        return out

    def _note_epoch(self, res: GenResult, start_epoch: int, start_version: str | None) -> None:
        # Holding pause modes keep the request on the engine while weights change under it.
        if self.gate.epoch != start_epoch and start_version is not None and start_version not in res.weight_versions:
            res.weight_versions.insert(0, start_version)

    def _resume_or_fail(self, res: GenResult, finish: dict[str, object]) -> None:
        if res.abandoned:  # our own abort (the client left), not a weight-sync pause: never resubmit
            raise GenerationAbandoned(
                f"generation {res.rid_prefix} aborted after its client left ({finish.get('message')})"
            )
        res.resumes += 1
        if res.resumes > self.max_resumes:
            raise ServiceUnavailable(
                f"generation was interrupted {res.resumes} times (last: {finish.get('message')}); try again"
            )
        logger.info(
            "generation aborted after %d tokens (%s); resubmitting", len(res.response_ids), finish.get("message")
        )

    async def _segments(self, sp: dict[str, object], res: GenResult, submit: Submit) -> AsyncGenerator[str, None]:
        """The one abort-and-resume loop of both paths: ``submit`` sends one segment (``prompt + ids so far``,
        ``max_new_tokens`` less what was produced) and fills ``res`` and its :class:`_Segment`; an aborted
        segment is resubmitted (at most ``max_resumes`` times), anything else ends the generation. A
        generation that sampled nothing takes the version the engine reported for its last segment, else
        the gate's."""
        while True:
            await self.gate.wait_open()
            epoch, version = self.gate.epoch, self.gate.version
            seg = _Segment()
            async for delta in submit(self._segment_params(sp, len(res.response_ids)), res, seg):
                yield delta
            self._note_epoch(res, epoch, version)
            if seg.finish.get("type") != "abort":
                if not res.weight_versions:
                    res.add_version(seg.weight_version or self.gate.version)
                res.finish = seg.finish
                return
            self._resume_or_fail(res, seg.finish)
            if max_new_tokens(sp) - len(res.response_ids) <= 0:
                res.finish = {"type": "length", "length": max_new_tokens(sp)}
                return

    async def generate(self, prompt_ids: list[int], sp: dict[str, object], res: GenResult | None = None) -> GenResult:
        """Non-streaming generation with transparent resume; fills ``res`` (made here when not given)."""
        res = res if res is not None else GenResult(prompt_ids=list(prompt_ids))
        async for _ in self._segments(sp, res, self._submit_once):
            pass
        return res

    def stream(self, prompt_ids: list[int], sp: dict[str, object], res: GenResult) -> AsyncGenerator[str, None]:
        """Streaming generation: yields text deltas as tokens arrive; fills ``res`` (token-exact) as it goes."""
        return self._segments(sp, res, self._submit_streaming)

    async def _submit_once(self, seg_sp: dict[str, object], res: GenResult, seg: _Segment) -> AsyncGenerator[str, None]:
        """One segment through ``/generate`` (non-streaming): yields nothing."""
        gens = await (res.engine or self.engine).generate_ids(
            res.input_ids(),
            seg_sp,
            return_logprob=True,
            rid=res.next_rid(),
            deadline_s=self.deadline_s,
            top_logprobs_num=res.top_logprobs_num,
        )
        g = gens[0]
        if res.cached_tokens is None and isinstance(g.meta_info.get("cached_tokens"), int):
            res.cached_tokens = g.meta_info["cached_tokens"]
        if g.output_ids:
            res.add_version(g.weight_version)
        res.response_ids += g.output_ids
        res.logprobs += g.output_logprobs or []
        if res.top_logprobs_num:
            res.top_logprobs += g.output_top_logprobs or [[] for _ in g.output_ids]
        res.text += g.text
        seg.finish, seg.weight_version = g.finish_reason, g.weight_version
        return
        yield  # an async generator that yields nothing (the loop's one shape for both paths)

    async def _submit_streaming(
        self, seg_sp: dict[str, object], res: GenResult, seg: _Segment
    ) -> AsyncGenerator[str, None]:
        """One segment through streaming ``/generate``: yields text deltas as tokens arrive.

        SGLang chunks are cumulative per submission, so each chunk's new ids/log-probs/text are the
        suffix beyond the previous chunk of the same submission.
        """
        payload: dict[str, object] = {
            "input_ids": res.input_ids(),
            "sampling_params": seg_sp,
            "return_logprob": True,
        }
        rid = res.next_rid()
        if rid:
            payload["rid"] = rid
        if res.top_logprobs_num:
            payload["top_logprobs_num"] = res.top_logprobs_num
        seen_ids = seen_text = 0
        finish: dict[str, object] | None = None
        async for chunk in (res.engine or self.engine).stream_generate(payload, deadline_s=self.deadline_s):
            meta = chunk.get("meta_info") or {}
            if res.cached_tokens is None and isinstance(meta.get("cached_tokens"), int):
                res.cached_tokens = meta["cached_tokens"]
            ids = chunk.get("output_ids") or []
            lps = meta.get("output_token_logprobs") or []
            if len(lps) != len(ids):
                raise EngineBadResponse(f"stream chunk has {len(ids)} ids but {len(lps)} log-probs")
            new = ids[seen_ids:]
            if new:
                if [int(e[1]) for e in lps[seen_ids:]] != [int(t) for t in new]:
                    raise EngineBadResponse("stream chunk log-prob ids differ from output_ids")
                if any(e[0] is None for e in lps[seen_ids:]):
                    raise EngineBadResponse("stream chunk has a null log-prob for a sampled token")
                res.response_ids += [int(t) for t in new]
                res.logprobs += [float(e[0]) for e in lps[seen_ids:]]
                if res.top_logprobs_num:
                    rows = (meta.get("output_top_logprobs") or [])[seen_ids : len(ids)]
                    rows += [[]] * (len(new) - len(rows))
                    res.top_logprobs += [[(float(t[0]), int(t[1])) for t in (row or [])] for row in rows]
                res.add_version(meta.get("weight_version"))
                seen_ids = len(ids)
            seg.weight_version = meta.get("weight_version") or seg.weight_version
            fr = meta.get("finish_reason")
            text = chunk.get("text") or ""
            if not fr:
                # An incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives: wait for it.
                text = text.rstrip("\ufffd")
            if len(text) > seen_text:
                delta = text[seen_text:]
                seen_text = len(text)
                res.text += delta
                yield delta
            if fr:
                finish = {"type": fr} if isinstance(fr, str) else fr
        if finish is None:
            raise EngineBadResponse("engine stream ended without a finish_reason")
        seg.finish = finish
