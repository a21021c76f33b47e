"""Per-step logit processing and sampling for the dev engine, following SGLang 0.5.23's sampler.

Contract (SGLang 0.5.23 sampling parameters and log-probs):

- Greedy: a temperature below 1e-6 becomes ``top_k=1, temperature=1`` (SGLang's normalisation), so greedy
  log-probs are the raw model log-probs.
- Order per step: penalties and ``logit_bias`` and the grammar/min-token masks modify the raw logits;
  the result is divided by the temperature; **log-probs are ``log_softmax`` of that temperature-scaled,
  masked distribution, before top-k/top-p/min-p truncation** (SGLang computes ``logprobs`` in the sampler
  from the scaled logits and truncates only the sampling probabilities). Scoring with ``max_new_tokens=0``
  at the same temperature therefore returns exactly the log-probs that sampling reported (no mask there).
- Sampling draws from the truncated, renormalised probabilities with a per-request ``torch.Generator``
  (``sampling_seed`` makes it reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-6
TOP_K_ALL = 1 << 30


@dataclass
class SamplingConfig:
    """Resolved sampling parameters of one request (all ``n`` samples share them)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    n: int = 1
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # ("regex" | "json_schema" | "ebnf", source) when constrained decoding was asked for
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def apply_penalties(logits: torch.Tensor, generated: torch.Tensor | None, cfg: SamplingConfig) -> None:
    """In place on ``logits`` (n, V); ``generated`` (n, t) are the ids sampled so far (None before the first)."""
    if cfg.logit_bias:
        ids = torch.tensor(list(cfg.logit_bias.keys()), dtype=torch.long)
        vals = torch.tensor(list(cfg.logit_bias.values()), dtype=logits.dtype)
        logits[:, ids] += vals
    if generated is None or generated.shape[1] == 0:
        return
    if cfg.frequency_penalty or cfg.presence_penalty:
        counts = torch.zeros_like(logits)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=logits.dtype))
        logits -= cfg.frequency_penalty * counts + cfg.presence_penalty * (counts > 0).to(logits.dtype)
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen.scatter_(1, generated, True)
        scaled = torch.where(logits > 0, logits / cfg.repetition_penalty, logits * cfg.repetition_penalty)
        logits.copy_(torch.where(seen, scaled, logits))


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the temperature-adjusted distribution (what SGLang reports)."""
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits.float(), dim=-1)


def sample_tokens(logprobs: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """Pick one token per row of ``logprobs`` (n, V) after top-k/top-p/min-p truncation."""
    if cfg.greedy:
        return logprobs.argmax(dim=-1)
    probs = logprobs.exp()
    vocab = probs.shape[-1]
    if cfg.top_k < vocab:
        kth = torch.topk(probs, cfg.top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if cfg.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        # keep a token while the mass before it is below top_p (the first token always stays)
        drop_sorted = (cum - sorted_p) > cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if cfg.min_p > 0.0:
        floor = probs.max(dim=-1, keepdim=True).values * cfg.min_p
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def top_logprobs(logprobs_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The ``k`` most likely (logprob, token_id) pairs of one position, by rank."""
    if k <= 0:
        return []
    vals, ids = torch.topk(logprobs_row, min(k, logprobs_row.shape[-1]))
    return list(zip(vals.tolist(), ids.tolist(), strict=True))
