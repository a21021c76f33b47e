"""The dev engine's prefill plan (devkit/dev_server/prefill.py): chunked for an all-windowed model, one pass
otherwise; a prefix hit dropped when its full-attention remainder would cost more than the whole prompt.

Asserted: the plan's rules (pure); a windowed model prefilled in chunks gives the logits and the KV of one pass
(every position's logits, a continuation from the chunked cache, a chunked remainder after a held prefix),
within float32 rounding of the same sums taken in another order; and the served path (ModelRunner) samples the
same ids with the same log-probs whether it chunks or not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from devkit.dev_server import prefill
from tests.testkit.models import windowed_qwen3

pytestmark = pytest.mark.unit

# Chunking changes only the order of float32 sums (attention over the same keys): logits of magnitude ~10
# agree to a few ulps of 10 (1e-6 relative); 1e-4 leaves room for the two layers compounding it.
ATOL = 1e-4


def windowed(window: int = 16, layers: int = 2) -> SimpleNamespace:
    return SimpleNamespace(sliding_window=window, layer_types=["sliding_attention"] * layers)


def test_chunk_only_when_every_layer_is_windowed() -> None:
    assert prefill.chunk_tokens(windowed(768)) == 1536
    assert prefill.chunk_tokens(windowed(16)) == prefill.MIN_CHUNK_TOKENS
    assert prefill.chunk_tokens(SimpleNamespace(sliding_window=None, layer_types=["full_attention"] * 2)) is None
    mixed = SimpleNamespace(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    assert prefill.chunk_tokens(mixed) is None
    assert prefill.chunk_tokens(SimpleNamespace()) is None  # a config without the fields (older architectures)


@pytest.mark.parametrize(
    ("reused", "prompt_len", "chunked", "worth"),
    [
        (0, 100, False, False),  # a miss
        (90, 100, False, True),  # short remainder
        (345, 32072, False, False),  # long full-attention remainder after a short hit: recompute
        (345, 2000, False, True),  # remainder under MIN_MASKED_TOKENS: cheap either way
        (16000, 32000, False, True),  # remainder no longer than the hit
        (345, 32072, True, True),  # chunked: the remainder costs the same either way
    ],
)
def test_worth_reusing(reused: int, prompt_len: int, chunked: bool, worth: bool) -> None:
    assert prefill.worth_reusing(reused, prompt_len, chunked) is worth


@pytest.fixture(scope="module")
def windowed_model() -> torch.nn.Module:
    return windowed_qwen3(24)


def cache_kw(model: torch.nn.Module) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def test_chunked_prefill_equals_one_pass(windowed_model: torch.nn.Module) -> None:
    kw = cache_kw(windowed_model)
    ids = torch.randint(0, 97, (1, 300))
    whole, whole_cache = prefill.forward(windowed_model, ids, None, kw, True, None)
    parts, part_cache = prefill.forward(windowed_model, ids, None, kw, True, 64)
    assert parts.shape == whole.shape == (1, 300, 97)
    assert torch.allclose(parts, whole, atol=ATOL)
    last, _ = prefill.forward(windowed_model, ids, None, kw, False, 64)
    assert last.shape == (1, 1, 97) and torch.allclose(last[0, -1], whole[0, -1], atol=ATOL)
    # decoding continues from the chunked KV exactly as from the one-pass KV
    nxt = torch.tensor([[5]])
    a = windowed_model(input_ids=nxt, use_cache=True, **{kw: whole_cache}).logits[0, -1]
    b = windowed_model(input_ids=nxt, use_cache=True, **{kw: part_cache}).logits[0, -1]
    assert torch.allclose(a, b, atol=ATOL)


@torch.inference_mode()
def test_chunked_remainder_after_a_held_prefix(windowed_model: torch.nn.Module) -> None:
    kw = cache_kw(windowed_model)
    ids = torch.randint(0, 97, (1, 260))
    whole, _ = prefill.forward(windowed_model, ids, None, kw, True, None)
    _, held = prefill.forward(windowed_model, ids[:, :20], None, kw, False, None)  # within the window: croppable
    rest, _ = prefill.forward(windowed_model, ids[:, 20:], held, kw, True, 64)
    assert torch.allclose(rest, whole[:, 20:], atol=ATOL)


def test_served_path_samples_the_same_with_and_without_chunks(tmp_path: Path) -> None:
    """ModelRunner over a windowed copy of the tiny policy: a prompt of several chunks, sampled with one seed."""
    from devkit.dev_server.control import EngineControl, RequestHandle
    from devkit.dev_server.model_runner import Job, ModelRunner
    from devkit.dev_server.sampling import SamplingConfig
    from devkit.model_cache import tiny_policy

    model = tmp_path / "windowed"
    shutil.copytree(tiny_policy(seed=0), model)
    cfg = json.loads((model / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg.update(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    cfg["layer_types"] = ["sliding_attention"] * layers
    (model / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(str(model), seed=0, control=EngineControl())
    assert runner._chunk == prefill.MIN_CHUNK_TOKENS
    prompt = [int(t) for t in torch.randint(10, 1000, (1400,), generator=torch.Generator().manual_seed(1))]

    def sample() -> tuple[list[int], list[float], list[float | None]]:
        job = Job(
            prompt_ids=prompt,
            sampling=SamplingConfig(max_new_tokens=12, ignore_eos=True, sampling_seed=7),
            handle=RequestHandle(rid="r"),
            return_logprob=True,
            logprob_start_len=1000,
        )
        res = runner.run(job)
        return res.samples[0].output_ids, res.samples[0].output_logprobs, res.input_logprobs

    chunked = sample()
    runner._chunk = None
    whole = sample()
    assert chunked[0] == whole[0]
    assert torch.allclose(torch.tensor(chunked[1]), torch.tensor(whole[1]), atol=ATOL)
    assert chunked[2][0] is None and whole[2][0] is None and len(chunked[2]) == len(whole[2]) == 400
    assert torch.allclose(torch.tensor(chunked[2][1:]), torch.tensor(whole[2][1:]), atol=ATOL)
