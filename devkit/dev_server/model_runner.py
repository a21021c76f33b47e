"""The dev engine's model worker: a real transformers forward pass with a KV cache, one request at a time per step.

Contract:

- ``run(job)`` is blocking and runs in a worker thread (the event loop stays free for /health).
  The model is guarded by one lock taken per forward step, so concurrent requests interleave at token
  granularity and a weight swap happens between steps, never inside one.
- One prefill per prompt; ``n`` samples share it (the KV cache is repeated n times) and decode as one
  batch of n rows. Rows that finished keep decoding a filler token that is never reported.
- Prefix cache (prefix_cache.py, like SGLang's radix cache): the prefill reuses the KV of the longest held
  prefix of the prompt and computes only the rest; ``RunResult.cached_tokens`` (-> ``meta_info.cached_tokens``)
  is the reused length. At least the last prompt token is always computed, and with input log-probs the
  reuse stops at ``logprob_start_len`` (those positions need their logits). Like SGLang's radix cache, a
  finished single-sample request also leaves the KV of its prompt plus its output (all but the last
  sampled token, whose KV was never computed), so a next turn that continues prompt + reply reuses both.
  Outputs are the same with and without it (same sampled ids; log-probs equal up to float rounding).
  Cleared on every weight swap. prefill.py decides how the rest is computed: in chunks for an all-windowed
  model, in one pass otherwise, and drops a hit whose full-attention remainder would cost more than the whole.
- Input log-probs follow SGLang 0.5.23: they cover ``prompt[logprob_start_len:]``, entry
  0 is null, entry k is log p(prompt[start+k] | prompt[:start+k]) of the temperature-scaled distribution.
  Output log-probs come from the very logits the token was sampled from (see sampling.py for the order).
- Finish: a stop token (EOS unless ``ignore_eos``, or ``stop_token_ids``) or a terminated grammar ->
  ``{"type":"stop","matched":id}``; a stop string -> ``{"type":"stop","matched":str}``; the budget ->
  ``{"type":"length","length":max_new_tokens}``; an abort -> ``{"type":"abort","message":...}``.
  ``output_ids`` keep the matched stop token; only the text is trimmed (unless ``no_stop_trim``).
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from devkit.dev_server import prefill
from devkit.dev_server.control import EngineControl, RequestHandle
from devkit.dev_server.grammar import GrammarBackend
from devkit.dev_server.prefix_cache import PrefixCache
from devkit.dev_server.sampling import SamplingConfig, apply_penalties, sample_tokens, scaled_logprobs, top_logprobs
from engine.chat import load_tokenizer
from engine.validation import bounded_message, clip

logger = logging.getLogger(__name__)


class WeightLoadError(Exception):
    """The weights at the given path cannot replace the current ones."""


@dataclass
class Job:
    """One prompt with its resolved parameters (n samples)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    handle: RequestHandle
    return_logprob: bool = False
    logprob_start_len: int = -1  # resolved: -1 means len(prompt) (0.5.23)
    top_logprobs_num: int = 0


@dataclass
class SequenceOutput:
    """One of the ``n`` sequences a dev-engine request samples, as it grows (not the training
    :class:`engine.records.Sample`)."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None


@dataclass
class RunResult:
    prompt_ids: list[int]
    samples: list[SequenceOutput]
    weight_version: str
    input_logprobs: list[float | None] = field(default_factory=list)
    input_ids_logged: list[int] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    aborted_before_prefill: bool = False
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    started_at: float = field(default_factory=time.monotonic)


StepCallback = Callable[[RunResult], None]


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        seed: int,
        control: EngineControl,
        weight_version: str = "default",
        prefix_cache_max_tokens: int = 0,
    ):
        self.prefix_cache = PrefixCache(prefix_cache_max_tokens)
        self.tokenizer = load_tokenizer(model_path)
        self.control = control
        self.model_path = model_path
        self.weight_version = weight_version
        self.model = self._load(model_path)
        cfg = self.model.config
        self._chunk = prefill.chunk_tokens(cfg)
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 4096))
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.filler_id = int(self.tokenizer.pad_token_id or min(self.eos_ids))
        self.grammar = GrammarBackend(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
        self.epoch = 0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        torch.manual_seed(seed)

    def _load(self, path: str) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        # transformers 5.2x renamed past_key_values -> cache; 4.x only knows the old name.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        return model.eval()

    # ------------------------------------------------------------------ weights
    def load_weights(self, path: str) -> None:
        """Load ``path`` off-lock, then swap it in between two decode steps."""
        try:  # a path too long for the OS (ENAMETOOLONG) or holding a NUL is a bad path, not a server fault
            is_dir = Path(path).is_dir()
        except (OSError, ValueError) as exc:
            raise WeightLoadError(f"model_path {clip(path)} is not a usable path ({type(exc).__name__})") from None
        if not is_dir:
            raise WeightLoadError(f"model_path {clip(path)} is not a local model folder")
        try:
            model = self._load(path)
        except Exception as exc:  # transformers raises OSError/ValueError/... for a broken folder
            raise WeightLoadError(f"failed to load weights from {clip(path)}: {bounded_message(str(exc))}") from exc
        if int(model.config.vocab_size) != self.vocab_size:
            raise WeightLoadError(f"vocab size {model.config.vocab_size} differs from the served {self.vocab_size}")
        with self._lock:
            self.model = model
            self._chunk = prefill.chunk_tokens(model.config)
            self.model_path = path
            self.epoch += 1
            self.prefix_cache.clear()  # held KV was computed by the old weights

    def _next_seed(self) -> int:
        with self._rng_lock:
            return self._rng.getrandbits(63)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def partial_text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of an unfinished sample for a stream chunk: a trailing incomplete UTF-8 sequence decodes to
        U+FFFD until its last byte is sampled, so it is held back, as SGLang's detokenizer does."""
        return self.decode(ids, skip_special_tokens).rstrip("\ufffd")

    # ------------------------------------------------------------------ generation
    def run(self, job: Job, on_step: StepCallback | None = None) -> RunResult:
        """Admit, prefill, decode; always returns (aborts are results, not exceptions)."""
        cfg = job.sampling
        result = RunResult(
            prompt_ids=job.prompt_ids,
            samples=[SequenceOutput() for _ in range(cfg.n)],
            weight_version=self.weight_version,
        )
        if not self.control.admit(job.handle):
            result.aborted_before_prefill = True
            self._finish_aborted(result, job.handle)
            return result
        with torch.inference_mode():
            self._generate(job, result, on_step)
        result.weight_version = self.weight_version
        return result

    def _prefill(self, ids: torch.Tensor, all_logits: bool) -> tuple[torch.Tensor, Any]:
        with self._lock:
            return prefill.forward(self.model, ids, None, self._cache_kw, all_logits, self._chunk)

    def _prefill_prompt(self, prompt: list[int], all_logits: bool, start: int) -> tuple[torch.Tensor, Any, int]:
        """Prefill through the prefix cache: (logits of prompt[reused:], KV of the whole prompt, reused)."""
        max_reuse = min(len(prompt) - 1, start) if all_logits else len(prompt) - 1
        with self._lock:  # lookup, forward and store under one lock: no weight swap can fall between them
            reused, past = self.prefix_cache.lookup(prompt, max_reuse)
            if not prefill.worth_reusing(reused, len(prompt), self._chunk is not None):
                reused, past = 0, None
            ids = torch.tensor([prompt[reused:]])
            logits, cache = prefill.forward(self.model, ids, past, self._cache_kw, all_logits, self._chunk)
            self.prefix_cache.store(prompt, cache)
        return logits, cache, reused

    def _generate(self, job: Job, result: RunResult, on_step: StepCallback | None) -> None:
        cfg, handle, prompt = job.sampling, job.handle, job.prompt_ids
        n, plen = cfg.n, len(prompt)
        start = plen if job.logprob_start_len < 0 else job.logprob_start_len
        want_input = job.return_logprob and start < plen
        epoch = self.epoch
        logits, cache, result.cached_tokens = self._prefill_prompt(prompt, want_input, start)
        if want_input:
            self._input_logprobs(job, result, logits[0], start, result.cached_tokens)
        if cfg.max_new_tokens == 0:
            for s in result.samples:
                s.finish_reason = {"type": "length", "length": 0}
            return
        if n > 1:
            cache.batch_repeat_interleave(n)
        next_logits = logits[0, -1:].expand(n, -1)
        generator = torch.Generator().manual_seed(
            cfg.sampling_seed if cfg.sampling_seed is not None else self._next_seed()
        )
        matchers = self.grammar.matchers(*cfg.grammar, n) if cfg.grammar else None
        stop_ids = set(cfg.stop_token_ids) | (set() if cfg.ignore_eos else self.eos_ids)
        stop_ids_t = torch.tensor(sorted(stop_ids), dtype=torch.long)
        max_stop_tokens = 4 * max((len(s) for s in cfg.stop), default=0) + 4
        prompt_t = torch.tensor([prompt]).expand(n, -1)
        gen = torch.empty((n, 0), dtype=torch.long)
        last = None
        for step in range(cfg.max_new_tokens):
            if not self.control.checkpoint(handle):
                self._finish_aborted(result, handle)
                return
            if handle.retracted:  # retract pause: recompute the KV cache with the (maybe new) weights
                handle.retracted = False
                logits, cache = self._prefill(torch.cat([prompt_t, gen], dim=1), False)
                next_logits = logits[:, -1]
            elif last is not None:
                with self._lock:
                    out = self.model(input_ids=last[:, None], use_cache=True, **{self._cache_kw: cache})
                next_logits, cache = out.logits[:, -1], prefill.cache_of(out)
            step_logits = next_logits.float().clone()
            apply_penalties(step_logits, gen, cfg)
            if step < cfg.min_new_tokens and len(stop_ids_t):
                step_logits[:, stop_ids_t] = float("-inf")
            active = [r for r, s in enumerate(result.samples) if s.finish_reason is None]
            if matchers:
                for r in active:
                    matchers[r].mask_logits(step_logits[r])
            lps = scaled_logprobs(step_logits, cfg.temperature)
            toks = sample_tokens(lps, cfg, generator)
            chosen = lps.gather(1, toks[:, None])[:, 0].tolist()
            tok_list = toks.tolist()
            for r in active:
                s, tok = result.samples[r], tok_list[r]
                s.output_ids.append(tok)
                s.output_logprobs.append(chosen[r])
                if job.top_logprobs_num:
                    s.output_top.append(top_logprobs(lps[r], job.top_logprobs_num))
                if matchers:
                    matchers[r].accept(tok)
                s.finish_reason = self._check_finish(
                    s, tok, cfg, stop_ids, matchers[r] if matchers else None, max_stop_tokens
                )
            for r in range(n):
                if r not in active:
                    tok_list[r] = self.filler_id
            last = torch.tensor(tok_list)
            gen = torch.cat([gen, last[:, None]], dim=1)
            result.weight_version = self.weight_version
            if on_step is not None:
                on_step(result)
            if all(s.finish_reason is not None for s in result.samples):
                if n == 1:
                    self._keep_output_kv(prompt, result.samples[0].output_ids, cache, epoch)
                return

    def _keep_output_kv(self, prompt: list[int], output_ids: list[int], cache: Any, epoch: int) -> None:
        """Hold the KV of prompt + output (but the last token, never fed back) like SGLang's finished-request
        insert; not when the weights changed during the request (that KV mixes two models)."""
        with self._lock:
            if self.epoch == epoch and len(output_ids) > 1:
                self.prefix_cache.store(prompt + output_ids[:-1], cache)

    def _check_finish(
        self, s: SequenceOutput, tok: int, cfg: SamplingConfig, stop_ids: set[int], matcher: Any, max_stop_tokens: int
    ) -> dict[str, Any] | None:
        produced = len(s.output_ids)
        if produced >= cfg.min_new_tokens:
            if tok in stop_ids or (matcher is not None and matcher.terminated):
                return {"type": "stop", "matched": tok}
            if cfg.stop:
                tail = self.decode(s.output_ids[-max_stop_tokens:], cfg.skip_special_tokens)
                for stop in cfg.stop:
                    if stop and stop in tail:
                        return {"type": "stop", "matched": stop}
        if produced >= cfg.max_new_tokens:
            return {"type": "length", "length": cfg.max_new_tokens}
        return None

    def _finish_aborted(self, result: RunResult, handle: RequestHandle) -> None:
        reason = {"type": "abort", "message": handle.abort_message or "Aborted", "status_code": None, "err_type": None}
        for s in result.samples:
            if s.finish_reason is None:
                s.finish_reason = dict(reason)

    def _input_logprobs(self, job: Job, result: RunResult, logits: torch.Tensor, start: int, offset: int) -> None:
        """Entries for prompt[start:], first null; logits row i predicts token offset+i+1 (offset <= start)."""
        prompt = job.prompt_ids
        targets = torch.tensor(prompt[start + 1 :], dtype=torch.long)
        lps = scaled_logprobs(logits[start - offset : len(prompt) - 1 - offset].float(), job.sampling.temperature)
        vals = lps.gather(1, targets[:, None])[:, 0].tolist() if len(targets) else []
        result.input_logprobs = [None, *vals]
        result.input_ids_logged = list(prompt[start:])
        if job.top_logprobs_num:
            result.input_top = [None, *(top_logprobs(lps[i], job.top_logprobs_num) for i in range(len(targets)))]

    def final_text(self, s: SequenceOutput, cfg: SamplingConfig) -> str:
        """Detokenized output with SGLang's stop trimming (text only; output_ids keep the stop)."""
        ids = s.output_ids
        fr = s.finish_reason or {}
        matched = fr.get("matched") if fr.get("type") == "stop" else None
        if isinstance(matched, int) and not cfg.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.decode(ids, cfg.skip_special_tokens)
        if isinstance(matched, str) and not cfg.no_stop_trim:
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        return text
