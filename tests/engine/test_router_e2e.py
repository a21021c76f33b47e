"""Two dev engines behind the real sglang-router 0.3.2, all on 127.0.0.1.

Contract: the router registers dev engines (waits on
/readiness), round_robin reaches both, /generate with input_ids + logprobs passes through unchanged,
/v1/chat/completions works with the openai client; with one engine killed the EngineClient still
succeeds through the other; with none it raises EngineUnavailable. Each engine runs with its own
``--weight-version`` so ``meta_info.weight_version`` tells which engine served a request.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import pytest

from engine.client import EngineClient, RetryPolicy
from engine.errors import EngineUnavailable
from tests.testkit.procs import ManagedProcess, start_dev_engine, start_router

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"),
]

PROMPT = [75, 72, 79, 524, 300, 301, 302]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[ManagedProcess, ManagedProcess, ManagedProcess]]:
    logs = tmp_path_factory.mktemp("router-logs")
    engines: list[ManagedProcess] = []
    router = None
    try:
        for name in ("A", "B"):
            engines.append(
                start_dev_engine(
                    tiny_model_dir,
                    log_dir=logs,
                    name=f"engine-{name}",
                    extra_args=["--weight-version", name, "--served-model-name", "tiny"],
                )
            )
        router = start_router([e.url for e in engines], log_dir=logs)
        yield engines[0], engines[1], router
    finally:
        for mp in [router, *engines]:
            if mp is not None:
                mp.stop()


def router_client(router: ManagedProcess, deadline_s: float = 20.0) -> EngineClient:
    return EngineClient(
        router.url, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.2, max_backoff_s=1.0, deadline_s=deadline_s)
    )


async def test_round_robin_reaches_both_and_logprobs_pass_through(stack):
    engine_a, _, router = stack
    async with router_client(router) as client:
        served = []
        for _ in range(4):
            gens = await client.generate_ids(
                PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, top_logprobs_num=2
            )
            assert len(gens[0].output_ids) == len(gens[0].output_logprobs) == 6
            assert len(gens[0].output_top_logprobs) == 6
            served.append(gens[0].weight_version)
        assert set(served) == {"A", "B"}
        # both engines hold the same weights: the router path returns what the engine itself returns
        async with EngineClient(engine_a.url) as direct:
            ref = (await direct.generate_ids(PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}))[0]
        assert gens[0].output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(gens[0].output_logprobs, ref.output_logprobs, strict=True)) < 1e-5
        scored = await client.score(PROMPT, ref.output_ids)
        assert scored.token_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(scored.logprobs, ref.output_logprobs, strict=True)) < 1e-4
        info = await client.model_info()  # the router only serves /get_model_info (0.3.2)
        assert info["served_model_name"] == "tiny"


def test_chat_through_router_with_openai_client(stack):
    openai = pytest.importorskip("openai")
    *_, router = stack
    oc = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", http_client=httpx.Client(trust_env=False))
    resp = oc.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2, logprobs=True, top_logprobs=1
    )
    assert len(resp.choices) == 2 and all(ch.logprobs.content for ch in resp.choices)
    assert 0 < resp.usage.completion_tokens <= 10
    chunks = list(
        oc.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason


async def test_failover_then_unavailable(stack):
    engine_a, engine_b, router = stack
    engine_a.kill()
    async with router_client(router) as client:
        for _ in range(3):  # the router retries the dead worker's requests on the live one
            gens = await client.generate_ids(PROMPT, {"max_new_tokens": 3})
            assert gens[0].weight_version == "B" and len(gens[0].output_ids) == 3
    engine_b.kill()
    async with router_client(router, deadline_s=15.0) as client:
        with pytest.raises(EngineUnavailable):
            await client.generate_ids(PROMPT, {"max_new_tokens": 3})
