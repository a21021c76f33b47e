"""How the dev engine prefills a prompt on CPU: in one pass or in chunks, and when a held prefix is worth reusing.

Contract:
- ``chunk_tokens(config)``: the prefill chunk length for a model whose every layer attends through a sliding
  window (each chunk then attends to at most ``window + chunk`` keys, so a long prompt costs linear time and
  memory, as SGLang's chunked prefill bounds them), else ``None``: one pass. A full-attention model is not
  chunked because on CPU one causal pass is the cheapest way through it (torch's flash kernel skips the upper
  triangle; a chunk against its prefix takes the masked path, which cannot): measured on the tiny policy at
  33k tokens, 5.5 s in one pass, 10.2 s in 2048-token chunks, while the windowed tool policy takes 22.5 s in
  one pass (its window is a dense 33k x 33k mask) and 1.6 s in chunks.
- ``worth_reusing(reused, prompt_len, chunked)``: whether a prefix-cache hit of ``reused`` tokens should be used.
  For the same reason a full-attention remainder longer than the reused part (and than ``MIN_MASKED_TOKENS``)
  costs more against the cached prefix than the whole prompt from scratch (measured: 31.7k tokens after a
  345-token hit, 34.5 s; the same 32k-token prompt cold, 16.5 s), so such a hit is dropped. Outputs are the same
  either way (up to float rounding), only ``cached_tokens`` reports what was reused.
- ``forward(model, ids, cache, cache_kw, all_logits, chunk)``: the prefill forward of ``ids`` (B, L) after
  ``cache`` (``None``: from scratch); returns (logits of every position when ``all_logits``, else of the
  last, and the extended cache).
"""

from __future__ import annotations

from typing import Any

import torch

MIN_MASKED_TOKENS = 2048  # below this a masked remainder costs little next to the forward's fixed overhead
MIN_CHUNK_TOKENS = 512


def chunk_tokens(config: Any) -> int | None:
    """Chunk length for an all-windowed model (twice its window, at least MIN_CHUNK_TOKENS), else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or not layer_types or any(t != "sliding_attention" for t in layer_types):
        return None
    return max(MIN_CHUNK_TOKENS, 2 * int(window))


def worth_reusing(reused: int, prompt_len: int, chunked: bool) -> bool:
    """Whether a hit of ``reused`` of ``prompt_len`` tokens is cheaper than prefilling the prompt whole."""
    rest = prompt_len - reused
    return reused > 0 and (chunked or rest <= reused or rest < MIN_MASKED_TOKENS)


def cache_of(out: Any) -> Any:
    """The KV cache of a forward's output (transformers 5.2x calls it ``cache``, earlier ones ``past_key_values``)."""
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")


def forward(
    model: Any, ids: torch.Tensor, cache: Any, cache_kw: str, all_logits: bool, chunk: int | None
) -> tuple[torch.Tensor, Any]:
    """Prefill ``ids`` after ``cache`` in one pass or in ``chunk``-token pieces (see the module docstring)."""
    step = chunk or ids.shape[1]
    pieces = []
    for start in range(0, ids.shape[1], step):
        kw = {cache_kw: cache} if cache is not None else {}
        out = model(input_ids=ids[:, start : start + step], use_cache=True, logits_to_keep=0 if all_logits else 1, **kw)
        cache = cache_of(out)
        if all_logits or start + step >= ids.shape[1]:
            pieces.append(out.logits)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), cache
