"""The dev engine's request service: turns validated requests into model-runner jobs and jobs into SGLang JSON.

Contract: everything ``/generate`` and ``/v1/chat/completions`` share (tokenisation, semantic checks,
running jobs off the event loop, abort on client disconnect) and the control plane
(pause/continue/abort/update weights). The HTTP layer (app.py) stays thin and only maps errors.
Jobs run on a dedicated thread pool sized ``max_running_requests``, so requests held by a pause never
starve the default executor; ``/health`` never touches the model and answers while generating.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from devkit.dev_server.control import PAUSE_MODES, EngineControl, RequestHandle
from devkit.dev_server.grammar import GrammarError
from devkit.dev_server.metrics import EngineMetrics
from devkit.dev_server.model_runner import Job, ModelRunner, RunResult, StepCallback, WeightLoadError
from devkit.dev_server.protocol import (
    GenerateSpec,
    ProtocolError,
    build_meta,
    check_prompt,
    new_rid,
    parse_generate,
    resolve_sampling,
    top_rows,
    triples,
)
from devkit.dev_server.settings import DevEngineSettings
from engine.validation import clip

logger = logging.getLogger(__name__)

ChunkMaker = Callable[["Prepared", RunResult, int], list[dict[str, Any]]]


async def sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """SGLang's SSE framing: ``data: <json>`` events, a mid-stream error event, then ``data: [DONE]``."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as exc:  # the status line is already sent: report in-band, as SGLang does
        logger.exception("stream failed")
        err = {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}
        yield f"data: {json.dumps({'error': err})}\n\n"
    yield "data: [DONE]\n\n"


@dataclass
class Prepared:
    """One prompt ready to run, with the ids the response reports for each of its n samples."""

    job: Job
    sample_rids: list[str]
    index_base: int  # position of sample 0 in the prompt-major output order


class DevEngine:
    def __init__(self, settings: DevEngineSettings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.control = EngineControl()
        self.runner = ModelRunner(
            settings.model_path,
            seed=settings.seed,
            control=self.control,
            weight_version=settings.weight_version,
            prefix_cache_max_tokens=settings.prefix_cache_max_tokens,
        )
        self.metrics = EngineMetrics(registry or CollectorRegistry(), self.served_model_name, self.control)
        self._pool = ThreadPoolExecutor(max_workers=settings.max_running_requests, thread_name_prefix="dev-engine")
        self._token_text: dict[int, str] = {}

    def close(self) -> None:
        self.control.pause("abort")  # wake every waiting job so the pool can drain
        self.control.resume()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def served_model_name(self) -> str:
        return self.settings.served_model_name or self.settings.model_path

    # ------------------------------------------------------------------ job plumbing
    def prepare(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        *,
        rid: str | None,
        return_logprob: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        index_base: int = 0,
    ) -> Prepared:
        check_prompt(prompt_ids, self.runner.vocab_size, logprob_start_len, top_logprobs_num)
        cfg = resolve_sampling(params, len(prompt_ids), self.runner.context_length)
        if cfg.grammar:
            try:
                self.runner.grammar.compile(*cfg.grammar)
            except GrammarError as exc:
                raise ProtocolError(str(exc)) from exc
        if cfg.n > 1:  # SGLang gives every parallel sample a fresh id; the caller's rid stays an abort prefix
            sample_rids = [new_rid() for _ in range(cfg.n)]
            handle = RequestHandle(rid=rid or sample_rids[0], extra_rids=sample_rids)
        else:
            sample_rids = [rid or new_rid()]
            handle = RequestHandle(rid=sample_rids[0])
        job = Job(
            prompt_ids=prompt_ids,
            sampling=cfg,
            handle=handle,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return Prepared(job=job, sample_rids=sample_rids, index_base=index_base)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(self.runner.tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt

    async def run(self, prepared: Prepared, on_step: StepCallback | None = None) -> RunResult:
        handle = prepared.job.handle
        self.control.register(handle)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        # run_in_executor does not carry contextvars: copy them so worker-thread logs keep the request id.
        ctx = contextvars.copy_context()
        try:
            result = await loop.run_in_executor(self._pool, ctx.run, self.runner.run, prepared.job, on_step)
        except asyncio.CancelledError:  # client went away: stop spending the model on it
            handle.aborted, handle.abort_message = True, "client disconnected"
            raise
        finally:
            self.control.release(handle)
        self.metrics.observe_finished(
            prompt_len=len(prepared.job.prompt_ids),
            output_lens=[len(s.output_ids) for s in result.samples],
            prefilled=not result.aborted_before_prefill,
            duration_s=time.perf_counter() - started,
        )
        return result

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.runner.decode([token_id], skip_special_tokens=False)
        return text

    # ------------------------------------------------------------------ /generate
    def prepare_generate(self, body: Any) -> tuple[GenerateSpec, list[Prepared]]:
        spec = parse_generate(body)
        prepared, base = [], 0
        for i, prompt in enumerate(spec.prompts):
            ids = self.tokenize(prompt)
            p = self.prepare(
                ids,
                spec.sampling_params[i],
                rid=spec.rids[i],
                return_logprob=spec.return_logprob[i],
                logprob_start_len=spec.logprob_start_len[i],
                top_logprobs_num=spec.top_logprobs_num[i],
                index_base=base,
            )
            base += p.job.sampling.n
            prepared.append(p)
        return spec, prepared

    def shape_sample(
        self, spec: GenerateSpec, p: Prepared, result: RunResult, k: int, *, final: bool = True
    ) -> dict[str, Any]:
        job, sample = p.job, result.samples[k]
        if final or sample.finish_reason is not None:
            text = self.runner.final_text(sample, job.sampling)
        else:
            text = self.runner.partial_text(sample.output_ids, job.sampling.skip_special_tokens)
        meta = build_meta(
            rid=p.sample_rids[k],
            finish_reason=sample.finish_reason,
            prompt_ids=job.prompt_ids,
            output_ids=sample.output_ids,
            weight_version=result.weight_version,
            started_at=result.started_at,
            aborted_before_prefill=result.aborted_before_prefill,
            cached_tokens=result.cached_tokens,
        )
        if job.return_logprob and not result.aborted_before_prefill:
            with_text = spec.return_text_in_logprobs
            tt = self.token_text if with_text else None
            meta["input_token_logprobs"] = triples(
                result.input_logprobs, result.input_ids_logged, [tt(t) for t in result.input_ids_logged] if tt else None
            )
            meta["output_token_logprobs"] = triples(
                sample.output_logprobs, sample.output_ids, [tt(t) for t in sample.output_ids] if tt else None
            )
            meta["output_token_logprobs_length"] = len(sample.output_ids)
            if job.top_logprobs_num > 0:
                meta["input_top_logprobs"] = top_rows(result.input_top, tt)
                meta["output_top_logprobs"] = top_rows(sample.output_top, tt)
        item: dict[str, Any] = {"text": text, "output_ids": list(sample.output_ids), "meta_info": meta}
        if spec.return_prompt_token_ids:
            item["prompt_token_ids"] = list(job.prompt_ids)
        return item

    async def generate(self, body: Any) -> Any:
        spec, prepared = self.prepare_generate(body)
        results = await asyncio.gather(*(self.run(p) for p in prepared))
        items = [
            self.shape_sample(spec, p, r, k)
            for p, r in zip(prepared, results, strict=True)
            for k in range(p.job.sampling.n)
        ]
        return items if (spec.is_batch or len(items) > 1) else items[0]

    def stream_generate(self, body: Any) -> AsyncIterator[str]:
        """Validate now (errors become HTTP 400), then stream cumulative SSE chunks ending in [DONE]."""
        spec, prepared = self.prepare_generate(body)
        indexed = spec.is_batch or len(prepared) * prepared[0].job.sampling.n > 1

        def make(p: Prepared, result: RunResult, k: int) -> list[dict[str, Any]]:
            item = self.shape_sample(spec, p, result, k, final=False)
            if indexed:
                item["index"] = p.index_base + k
            return [item]

        return sse(self.iter_chunks(prepared, make))

    async def iter_chunks(self, prepared: list[Prepared], make: ChunkMaker) -> AsyncIterator[dict[str, Any]]:
        """Run the jobs and yield ``make``'s chunks: one call per new token while a sample runs (in the worker
        thread), then exactly one call per sample once it has finished (with its finish_reason set)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        def on_step_for(p: Prepared) -> StepCallback:
            sent = [0] * p.job.sampling.n

            def on_step(result: RunResult) -> None:  # worker thread: shape here, enqueue on the loop
                for k, s in enumerate(result.samples):
                    if s.finish_reason is None and len(s.output_ids) > sent[k]:
                        sent[k] = len(s.output_ids)
                        loop.call_soon_threadsafe(queue.put_nowait, make(p, result, k))

            return on_step

        async def run_one(p: Prepared) -> None:
            result = await self.run(p, on_step_for(p))
            for k in range(p.job.sampling.n):
                queue.put_nowait(make(p, result, k))

        tasks = [asyncio.create_task(run_one(p)) for p in prepared]
        gathered = asyncio.gather(*tasks)
        gathered.add_done_callback(lambda _: queue.put_nowait(done))
        try:
            while (chunks := await queue.get()) is not done:
                for chunk in chunks:
                    yield chunk
            if not gathered.cancelled() and gathered.exception() is not None:
                raise gathered.exception()  # type: ignore[misc]
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ control plane
    async def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path (a string) is required")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise ProtocolError("weight_version must be a string")
        abort_all = bool(body.get("abort_all_requests", False))

        def update() -> int:
            paused = self.control.begin_update(abort_all, self.settings.update_wait_timeout_s)
            try:
                self.runner.load_weights(path)
            finally:
                self.control.end_update()
            return paused

        try:
            paused = await asyncio.get_running_loop().run_in_executor(self._pool, update)
        except (WeightLoadError, TimeoutError) as exc:
            logger.warning("update_weights_from_disk(%s) failed: %s", clip(path), exc)
            return 400, {"success": False, "message": str(exc), "num_paused_requests": 0}
        if version is not None:
            self.runner.weight_version = version
        self.settings.model_path = path
        logger.info("weights updated from %s (weight_version=%s)", path, self.runner.weight_version)
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}

    def update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise ProtocolError("new_version (a string) is required")
        if body.get("abort_all_requests", True):
            self.control.abort("", abort_all=True)
        self.runner.weight_version = version
        return {"success": True, "message": "Weight version updated", "new_version": version}

    def pause(self, body: dict[str, Any]) -> dict[str, Any]:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.control.pause(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        self.control.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort(self, body: dict[str, Any]) -> int:
        rid = body.get("rid", "") or ""
        if not isinstance(rid, str):
            raise ProtocolError("rid must be a string")
        return self.control.abort(rid, bool(body.get("abort_all", False)))
