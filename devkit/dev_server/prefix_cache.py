"""The dev engine's prefix cache: computed KV of recent prompts, reused for the longest shared prefix.

Contract:
- ``PrefixCache(max_tokens)`` keeps the KV cache (a transformers ``DynamicCache``) of recently prefilled
  prompts, least recently used first out, bounded by the total number of prompt tokens held
  (``max_tokens``; 0 disables it). It plays the role of SGLang's radix cache: a later prompt that shares a
  prefix with a held one prefills only the rest, and the engine reports the reused length as
  ``meta_info.cached_tokens``.
- ``lookup(prompt_ids, max_reuse)`` returns ``(n, cache)``: ``n`` tokens of the longest held prefix of
  ``prompt_ids`` (at most ``max_reuse``, which the caller keeps below the prompt length so at least one
  token is computed for the next-token logits), and a private copy of their KV cropped to ``n`` tokens
  (the caller extends it in place during decode, so the held entry is never mutated); ``(0, None)`` on a miss,
  and also when the held KV cannot be cropped (a sliding-window model's layers past their window).
- ``store(prompt_ids, cache)`` holds a copy of a prompt's KV right after its prefill. An entry whose ids are
  a prefix of the new prompt is dropped (the new entry serves every lookup it served). A prompt longer
  than ``max_tokens`` is not held.
- ``clear()`` empties it; the engine calls it when the weights change, since held KV belongs to the old
  weights (SGLang flushes its cache on a weight update too).
Thread-safe: one lock around the index; the KV copy happens under it (cheap next to a forward pass).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU of prompt KV caches bounded by tokens (see module docstring)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt_ids: list[int], max_reuse: int) -> tuple[int, Any | None]:
        if self.max_tokens <= 0 or max_reuse <= 0:
            return 0, None
        key = tuple(prompt_ids)
        with self._lock:
            best_len, best_key = 0, None
            for held in self._entries:
                n = common_prefix_len(held, key)
                if n > best_len:
                    best_len, best_key = n, held
            n = min(best_len, max_reuse)
            if best_key is None or n <= 0:
                return 0, None
            self._entries.move_to_end(best_key)
            kv = copy.deepcopy(self._entries[best_key])
        if len(best_key) > n:
            try:
                kv.crop(n - len(best_key))  # a negative count removes that many tokens (transformers 4.x and 5.x)
            except RuntimeError:
                # A sliding-window layer past its window holds only the window's keys, so it cannot roll back
                # to an earlier length: a miss, and the prompt is prefilled whole.
                return 0, None
        return n, kv

    def store(self, prompt_ids: list[int], cache: Any) -> None:
        key = tuple(prompt_ids)
        if self.max_tokens <= 0 or not key or len(key) > self.max_tokens:
            return
        kv = copy.deepcopy(cache)
        with self._lock:
            for held in [h for h in self._entries if len(h) <= len(key) and key[: len(h)] == h]:
                del self._entries[held]
                self._tokens -= len(held)
            self._entries[key] = kv
            self._tokens += len(key)
            while self._tokens > self.max_tokens:
                old, _ = self._entries.popitem(last=False)
                self._tokens -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0
