"""The dev engine's prefix cache over HTTP: real KV reuse, reported as SGLang reports it, outputs unchanged.

Contract (SGLang's ``meta_info.cached_tokens``): a prompt sharing k leading ids with an earlier
one reports ``cached_tokens == k`` (at most len - 1: the last token is always computed); a fresh prompt
reports 0; an engine started with ``--prefix-cache-max-tokens 0`` always reports 0. The sampled ids of a
seeded request are the same with and without a cache hit, and the log-probs (input and output) agree to
1e-4 (float rounding of a split prefill); /flush_cache empties it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def uncached_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    logs = tmp_path_factory.mktemp("nocache-logs")
    with start_dev_engine(tiny_model_dir, log_dir=logs, extra_args=["--prefix-cache-max-tokens", "0"]) as mp:
        yield mp


def _fresh_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)  # ids unlikely to be shared with any other test's prompt on the shared engine
    return [rng.randrange(300, 900) for _ in range(n)]


def _generate(url: str, ids: list[int], **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7, "n": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
        **extra,
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=60, trust_env=False)
    r.raise_for_status()
    return r.json()


def _no_logprob(url: str, ids: list[int]) -> dict:
    r = httpx.post(
        f"{url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
        timeout=60,
        trust_env=False,
    )
    r.raise_for_status()
    return r.json()


def test_cached_tokens_reported(dev_engine):
    base = _fresh_prompt(1, 120)
    assert _no_logprob(dev_engine.url, base)["meta_info"]["cached_tokens"] == 0
    again = _no_logprob(dev_engine.url, base)["meta_info"]
    assert again["cached_tokens"] == len(base) - 1 and again["prompt_tokens"] == len(base)
    branch = base[:90] + _fresh_prompt(2, 40)
    assert _no_logprob(dev_engine.url, branch)["meta_info"]["cached_tokens"] == 90
    assert httpx.post(f"{dev_engine.url}/flush_cache", trust_env=False, timeout=30).status_code == 200
    assert _no_logprob(dev_engine.url, base)["meta_info"]["cached_tokens"] == 0


def test_outputs_identical_with_and_without_cache(dev_engine, uncached_engine):
    shared = _fresh_prompt(3, 150)
    prompt = shared + _fresh_prompt(4, 30)
    _no_logprob(dev_engine.url, shared + _fresh_prompt(5, 10))  # holds the shared 150-token prefix
    hit = _generate(dev_engine.url, prompt, logprob_start_len=160)  # input log-probs from past the reuse cap
    miss = _generate(uncached_engine.url, prompt, logprob_start_len=160)
    assert [h["meta_info"]["cached_tokens"] for h in hit] == [150] * 3
    assert [m["meta_info"]["cached_tokens"] for m in miss] == [0] * 3
    assert [h["output_ids"] for h in hit] == [m["output_ids"] for m in miss]
    for h, m in zip(hit, miss, strict=True):
        for key in ("output_token_logprobs", "input_token_logprobs"):
            hs, ms = h["meta_info"][key], m["meta_info"][key]
            assert [e[1] for e in hs] == [e[1] for e in ms]
            assert all((a[0] is None and b[0] is None) or abs(a[0] - b[0]) < 1e-4 for a, b in zip(hs, ms, strict=True))


def test_input_logprobs_cap_reuse(dev_engine):
    prompt = _fresh_prompt(6, 80)
    _no_logprob(dev_engine.url, prompt)
    out = _generate(dev_engine.url, prompt, logprob_start_len=20)
    assert out[0]["meta_info"]["cached_tokens"] == 20  # reuse stops where input log-probs begin
    assert len(out[0]["meta_info"]["input_token_logprobs"]) == 60


def test_a_finished_reply_is_cached_like_sglang(dev_engine, uncached_engine):
    """SGLang's radix cache keeps a finished request's prompt + output (all but the last sampled token, whose
    KV was never computed): a next turn that continues prompt + reply reuses both, and samples the same."""
    prompt = _fresh_prompt(7, 60)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True}}
    first = httpx.post(f"{dev_engine.url}/generate", json=body, timeout=60, trust_env=False).json()
    out = first["output_ids"]
    assert len(out) == 6
    nxt = prompt + out + _fresh_prompt(8, 12)
    seeded = {"max_new_tokens": 4, "sampling_seed": 5}
    hit = httpx.post(
        f"{dev_engine.url}/generate", json={"input_ids": nxt, "sampling_params": seeded}, timeout=60, trust_env=False
    ).json()
    assert hit["meta_info"]["cached_tokens"] == len(prompt) + len(out) - 1
    miss = httpx.post(
        f"{uncached_engine.url}/generate",
        json={"input_ids": nxt, "sampling_params": seeded},
        timeout=60,
        trust_env=False,
    ).json()
    assert miss["meta_info"]["cached_tokens"] == 0 and hit["output_ids"] == miss["output_ids"]
