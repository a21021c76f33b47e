"""EngineClient retry/error contract with fault injection (httpx.MockTransport), no sockets.

Contract (engine/client.py): retries only transport errors, 429 and 5xx with backoff inside a total
deadline; never retries 4xx (EngineRejected); a deadline overrun is EngineTimeout; exhausted retries are
EngineUnavailable; ``score`` verifies the returned ids and drops SGLang's leading null entry.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.client import EngineClient, RetryPolicy
from engine.errors import EngineBadResponse, EngineRejected, EngineTimeout, EngineUnavailable

pytestmark = pytest.mark.unit

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02, jitter_s=0.0, deadline_s=5.0)


def client_for(handler, retry: RetryPolicy = FAST) -> EngineClient:
    return EngineClient("http://engine.test", retry=retry, transport=httpx.MockTransport(handler))


def generate_body(ids: list[int], lps: list[float]) -> dict:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": 1,
            "weight_version": "v",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
        },
    }


async def test_retries_5xx_then_succeeds():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json=generate_body([5, 6], [-1.0, -2.0]))

    async with client_for(handler) as client:
        gens = await client.generate_ids([1, 2], {"max_new_tokens": 2})
    assert len(calls) == 3 and gens[0].output_ids == [5, 6] and gens[0].output_logprobs == [-1.0, -2.0]


async def test_retries_transport_errors_then_unavailable():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("refused", request=request)

    async with client_for(handler) as client:
        with pytest.raises(EngineUnavailable, match="after 4 attempt"):
            await client.generate({"input_ids": [1]})
    assert len(calls) == FAST.max_attempts


async def test_never_retries_4xx():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(400, json={"error": "unknown field `max_tokens`"})

    async with client_for(handler) as client:
        with pytest.raises(EngineRejected, match="max_tokens") as info:
            await client.generate({"input_ids": [1], "sampling_params": {"max_tokens": 1}})
    assert len(calls) == 1 and info.value.status_code == 400


async def test_deadline_raises_engine_timeout():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, json={})

    async with client_for(handler) as client:
        with pytest.raises(EngineTimeout):
            await client.generate({"input_ids": [1]}, deadline_s=0.2)


async def test_score_verifies_ids_and_drops_null_entry():
    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        assert body["logprob_start_len"] == 1 and body["sampling_params"]["max_new_tokens"] == 0
        return httpx.Response(
            200,
            json={
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "weight_version": "w",
                    "input_token_logprobs": [[None, 2, None], [-0.5, 7, None], [-1.5, 8, None]],
                },
            },
        )

    async with client_for(handler) as client:
        scored = await client.score([1, 2], [7, 8])
        assert scored.token_ids == [7, 8] and scored.logprobs == [-0.5, -1.5] and scored.weight_version == "w"
        with pytest.raises(EngineBadResponse, match="different token ids"):
            await client.score([1, 2], [7, 9])
        with pytest.raises(EngineBadResponse, match="expected 3"):
            await client.score([1, 2], [7, 8, 9])


async def test_generate_ids_checks_sample_count_and_logprob_ids():
    def handler(request: httpx.Request) -> httpx.Response:
        body = generate_body([5, 6], [-1.0, -2.0])
        body["meta_info"]["output_token_logprobs"][1][1] = 99  # ids disagree with output_ids
        return httpx.Response(200, json=body)

    async with client_for(handler) as client:
        with pytest.raises(EngineBadResponse, match="differ"):
            await client.generate_ids([1], {"max_new_tokens": 2})
        with pytest.raises(EngineBadResponse, match="n=2"):
            await client.generate_ids([1], {"max_new_tokens": 2, "n": 2}, return_logprob=False)
