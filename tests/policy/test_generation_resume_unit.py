"""Unit tests of the one abort-and-resume loop (policy_server.serving.generation.Generator), on both paths.

Contract: streaming and non-streaming generation resume an aborted segment the same way (``prompt + ids so
far``, ``max_new_tokens`` less what was produced, a fresh rid) and end with the same ids, log-probs, text
and weight versions; a generation that sampled nothing carries the version the engine reported for it,
else the weight gate's. The engine is the real EngineClient over an in-process transport that plays
SGLang's ``/generate`` (JSON, or SSE chunks when ``stream`` is set).
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.client import EngineClient
from engine.http_client import RetryPolicy
from policy_server.serving.generation import Generator, GenResult
from policy_server.serving.weight_sync import WeightGate

pytestmark = pytest.mark.unit


def engine(segments: list[tuple[list[int], str, str | None]], calls: list[dict]) -> EngineClient:
    """Answers call i with ``segments[i]``: (ids, finish type, reported weight version)."""

    def item(ids: list[int], finish: str, version: str | None) -> dict:
        meta = {"finish_reason": {"type": finish}, "output_token_logprobs": [[-0.25 * t, t, None] for t in ids]}
        if version is not None:
            meta["weight_version"] = version
        return {"text": "".join(chr(96 + t) for t in ids), "output_ids": ids, "meta_info": meta}

    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        calls.append(payload)
        ids, finish, version = segments[len(calls) - 1]
        if not payload.get("stream"):
            return httpx.Response(200, json=item(ids, finish, version))
        # SGLang's stream: cumulative chunks, the finish reason on the last one
        chunks = [item(ids[: k + 1], "", version) for k in range(len(ids))] + [item(ids, finish, version)]
        for c in chunks[:-1]:
            c["meta_info"]["finish_reason"] = None
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return EngineClient("http://engine", transport=httpx.MockTransport(handler), retry=RetryPolicy(max_attempts=1))


async def run(streaming: bool, segments: list[tuple[list[int], str, str | None]]) -> tuple[GenResult, list[dict]]:
    calls: list[dict] = []
    gen = Generator(engine(segments, calls), tokenizer=None, gate=WeightGate(5.0, "gate-v"))
    res = GenResult(prompt_ids=[1, 2], rid_prefix="hs-x-")
    if streaming:
        text = "".join([d async for d in gen.stream([1, 2], {"max_new_tokens": 8}, res)])
        assert text == res.text
    else:
        await gen.generate([1, 2], {"max_new_tokens": 8}, res)
    return res, calls


@pytest.mark.parametrize("streaming", [False, True])
async def test_an_aborted_segment_is_resumed_the_same_way(streaming: bool) -> None:
    res, calls = await run(streaming, [([5, 6], "abort", "v1"), ([7], "stop", "v2")])
    assert (res.response_ids, res.logprobs, res.text) == ([5, 6, 7], [-1.25, -1.5, -1.75], "efg")
    assert (res.weight_versions, res.resumes, res.finish) == (["v1", "v2"], 1, {"type": "stop"})
    assert [c["rid"] for c in calls] == ["hs-x-0", "hs-x-1"]
    assert calls[1]["input_ids"] == [1, 2, 5, 6] and calls[1]["sampling_params"]["max_new_tokens"] == 6


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(("reported", "expected"), [("v9", ["v9"]), (None, ["gate-v"])])
async def test_nothing_sampled_takes_the_engines_version_else_the_gates(
    streaming: bool, reported: str | None, expected: list[str]
) -> None:
    res, _ = await run(streaming, [([], "stop", reported)])
    assert res.response_ids == [] and res.weight_versions == expected
