"""Float32 tolerances derived from the computation, for tests that compare two computations of one value.

Two float32 computations of the same quantity that differ only in the order of their additions (another
batching or padding, merged rows, a sum across ranks, another kernel's blocking) each carry rounding error.
For a reduction of ``n`` terms of magnitude about ``scale`` that error grows like ``sqrt(n) * eps32 * scale``
(independent roundings add like a random walk; the worst case is ``n * eps32 * scale``). ``reorder_atol``
returns that bound times a safety factor, so a tolerance follows from what the path computes instead of
from the machine the test was written on; the caller states ``n`` and ``scale`` with a comment.

Where two paths can be made to compute the very same numbers (same shapes, same order, exact scalings),
tests compare with ``==`` / ``torch.equal`` instead: no tolerance at all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

EPS32 = float(torch.finfo(torch.float32).eps)  # 1.19e-7: one ulp of 1.0 in float32
# Covers chains of several reductions (a forward pass, then a loss, then its gradient) and the difference of
# two independently rounded results; still orders of magnitude below any error a logic bug produces.
SAFETY = 8.0


def forward_terms(config: object, seq_len: int) -> int:
    """Terms summed along one value's path through a decoder's forward pass (``config`` a transformers
    config): per layer the hidden and MLP matmuls and attention over up to ``seq_len`` positions."""
    layers, hidden, mlp = (int(getattr(config, k)) for k in ("num_hidden_layers", "hidden_size", "intermediate_size"))
    return layers * (hidden + mlp + seq_len)


def step_loss_terms(model_dir: Path, samples_file: Path, n_tokens: float) -> int:
    """Reductions a trainer step's loss over ``samples_file`` goes through: the forward pass over its longest
    row, then the token mean over ``n_tokens``. Two runs that batch the samples differently (DDP ranks pair them
    into other micro-batches and sum across ranks) are compared to :func:`reorder_atol` of these terms."""
    from transformers import AutoConfig

    rows = [json.loads(x) for x in Path(samples_file).read_text().splitlines() if x.strip()]
    longest = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in rows)
    return forward_terms(AutoConfig.from_pretrained(model_dir), longest) + int(n_tokens)


def logprob_atol(model_dir: Path | str, n_positions: int, logprobs: list[float]) -> float:
    """Tolerance between one model's log-probs from two forward passes (an engine's batched or cached pass and
    a test's own) over sequences of up to ``n_positions``: :func:`reorder_atol` of the forward's terms at the
    largest magnitude among ``logprobs``."""
    from transformers import AutoConfig

    terms = forward_terms(AutoConfig.from_pretrained(model_dir), n_positions)
    return reorder_atol(terms, max((abs(x) for x in logprobs), default=0.0))


def reorder_atol(n_terms: int, scale: float, safety: float = SAFETY) -> float:
    """Absolute tolerance between two float32 sums of ``n_terms`` terms of magnitude ``scale`` that differ in
    summation order: ``safety * sqrt(n_terms) * eps32 * scale`` (at least one ulp of ``scale``)."""
    return safety * math.sqrt(max(1, n_terms)) * EPS32 * max(abs(scale), EPS32)


def assert_reordered_close(
    actual: torch.Tensor, expected: torch.Tensor, *, n_terms: int, scale: float | None = None, msg: str = ""
) -> None:
    """``actual`` equals ``expected`` up to :func:`reorder_atol` at ``scale``, the magnitude of the summed terms:
    by default ``expected``'s largest element; a result that cancels (a loss near 0) passes its terms' scale."""
    if scale is None:
        scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    atol = reorder_atol(n_terms, scale)
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=0.0, msg=lambda m: f"{msg} (atol {atol:.2e} from n={n_terms}): {m}"
    )
