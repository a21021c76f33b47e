"""End-to-end invariants of the dev engine over HTTP (one real engine process, shared, never mutated).

Contract under test (SGLang's /generate, /metrics and control endpoints): sampled-token log-probs equal the
scoring recipe's (max_new_tokens=0, logprob_start_len=len(prompt)-1) to 1e-4; returned token ids equal
the input ids; greedy is deterministic; seeded n=3 reproduces; regex output always matches; SGLang
response shapes; bad input -> 400 in SGLang's shapes; /health answers while a long generation runs.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from engine.client import EngineClient, RetryPolicy
from engine.errors import EngineRejected
from tests.testkit.procs import metric_value
from tests.waiting import async_wait_until

pytestmark = pytest.mark.e2e

PROMPT = [75, 72, 79, 524, 300, 301, 302, 17, 18]
BOXED = re.compile(r"\\boxed\{(1|0|-1)\}")


@pytest.fixture
async def client(dev_engine):
    async with EngineClient(dev_engine.url, retry=RetryPolicy(max_attempts=2, deadline_s=60)) as c:
        yield c


@pytest.fixture
def http(dev_engine):
    with httpx.Client(base_url=dev_engine.url, trust_env=False, timeout=60) as c:
        yield c


async def test_sampled_logprobs_equal_scoring(client):
    for temperature in (1.0, 0.7):
        gens = await client.generate_ids(
            PROMPT, {"max_new_tokens": 12, "temperature": temperature, "n": 3, "ignore_eos": True, "sampling_seed": 11}
        )
        assert len(gens) == 3
        for gen in gens:
            scored = await client.score(PROMPT, gen.output_ids, temperature=temperature)
            assert scored.token_ids == gen.output_ids
            assert max(abs(a - b) for a, b in zip(scored.logprobs, gen.output_logprobs, strict=True)) < 1e-4


async def test_input_logprobs_cover_prompt_with_null_first(client):
    raw = await client.generate(
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
        }
    )
    meta = raw["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT  # returned ids equal input ids
    assert meta["input_token_logprobs"][0][0] is None and all(e[0] < 0 for e in meta["input_token_logprobs"][1:])
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT)
    for row, entry in zip(meta["input_top_logprobs"][1:], meta["input_token_logprobs"][1:], strict=True):
        assert [t[0] for t in row] == sorted((t[0] for t in row), reverse=True) and entry[0] <= row[0][0] + 1e-6
    assert raw["output_ids"] == [] and raw["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["prompt_tokens"] == len(PROMPT)
    default = await client.generate(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    )
    assert default["meta_info"]["input_token_logprobs"] == []  # 0.5.23: -1 means len(prompt)
    mid = await client.generate(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 4}
    )
    assert [e[1] for e in mid["meta_info"]["input_token_logprobs"]] == PROMPT[4:]
    assert mid["meta_info"]["input_token_logprobs"][0][0] is None


async def test_greedy_is_deterministic_and_seeded_n3_reproduces(client):
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    a = await client.generate_ids(PROMPT, params)
    b = await client.generate_ids(PROMPT, params)
    both = await client.generate_ids(PROMPT, {**params, "n": 2})
    assert a[0].output_ids == b[0].output_ids == both[0].output_ids == both[1].output_ids
    seeded = {"max_new_tokens": 16, "temperature": 1.0, "n": 3, "sampling_seed": 1234, "ignore_eos": True}
    first = await client.generate_ids(PROMPT, seeded)
    again = await client.generate_ids(PROMPT, seeded)
    assert [g.output_ids for g in first] == [g.output_ids for g in again]
    assert [g.output_logprobs for g in first] == [g.output_logprobs for g in again]
    assert len({tuple(g.output_ids) for g in first}) > 1  # n samples are distinct draws
    other = await client.generate_ids(PROMPT, {**seeded, "sampling_seed": 99})
    assert [g.output_ids for g in other] != [g.output_ids for g in first]


async def test_n_samples_are_prompt_major_with_fresh_ids(client):
    raw = await client.generate(
        {
            "input_ids": [PROMPT, PROMPT[:4]],
            "rid": "batch",
            "sampling_params": {"max_new_tokens": 3, "n": 2},
            "return_logprob": True,
        }
    )
    assert isinstance(raw, list) and len(raw) == 4
    ids = [item["meta_info"]["id"] for item in raw]
    assert len(set(ids)) == 4 and "batch" not in ids
    assert [item["meta_info"]["prompt_tokens"] for item in raw] == [len(PROMPT)] * 2 + [4] * 2
    single = await client.generate(
        {"input_ids": [PROMPT, PROMPT], "rid": "r", "sampling_params": {"max_new_tokens": 1}}
    )
    assert [item["meta_info"]["id"] for item in single] == ["r_0", "r_1"]


async def test_regex_output_always_matches(client):
    eos = 2
    gens = await client.generate_ids(
        PROMPT, {"max_new_tokens": 24, "temperature": 1.0, "n": 6, "regex": r"\\boxed\{(1|0|-1)\}", "sampling_seed": 5}
    )
    for g in gens:
        assert BOXED.fullmatch(g.text), g.text
        assert g.finish_reason == {"type": "stop", "matched": eos} and g.output_ids[-1] == eos
        assert all(lp > -1e3 for lp in g.output_logprobs)


async def test_stop_token_and_stop_string_trim_text_only(client, dev_engine):
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    base = (await client.generate_ids(PROMPT, greedy, return_logprob=False))[0]
    stop_tok = base.output_ids[3]
    cut = (await client.generate_ids(PROMPT, {**greedy, "stop_token_ids": [stop_tok]}, return_logprob=False))[0]
    first = base.output_ids.index(stop_tok)
    assert cut.output_ids == base.output_ids[: first + 1]  # output_ids keep the stop token
    assert cut.finish_reason == {"type": "stop", "matched": stop_tok}
    kept = await client.generate(
        {"input_ids": PROMPT, "sampling_params": {**greedy, "stop_token_ids": [stop_tok], "no_stop_trim": True}}
    )
    assert len(kept["text"]) > len(cut.text)  # no_stop_trim keeps the stop in the text
    text_tail = base.text[len(base.text) // 2 :]
    stop_str = text_tail[:2] if text_tail[:2].strip() else text_tail[-2:]
    by_str = (await client.generate_ids(PROMPT, {**greedy, "stop": [stop_str]}, return_logprob=False))[0]
    assert by_str.finish_reason == {"type": "stop", "matched": stop_str}
    assert stop_str not in by_str.text and base.text.startswith(by_str.text)


async def test_text_input_and_return_text_in_logprobs(client):
    raw = await client.generate(
        {
            "text": "hello world",
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "top_logprobs_num": 2,
            "return_prompt_token_ids": True,
        }
    )
    meta = raw["meta_info"]
    assert raw["prompt_token_ids"] and meta["prompt_tokens"] == len(raw["prompt_token_ids"])
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert meta["output_token_logprobs_length"] == 3 and len(meta["output_top_logprobs"]) == 3
    assert all(len(row) == 2 and isinstance(row[0][2], str) for row in meta["output_top_logprobs"])
    # the shared engine may hold a prefix of this prompt from an earlier test (test_prefix_cache_e2e.py)
    assert meta["weight_version"] == "default" and 0 <= meta["cached_tokens"] < meta["prompt_tokens"]


async def test_stream_is_cumulative_and_ends_with_done(client):
    chunks = [
        c
        async for c in client.stream_generate(
            {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        )
    ]
    assert len(chunks) == 5
    for i, c in enumerate(chunks):
        assert len(c["output_ids"]) == i + 1 and len(c["meta_info"]["output_token_logprobs"]) == i + 1
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    multi = [
        c
        async for c in client.stream_generate(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 2, "ignore_eos": True}}
        )
    ]
    assert sorted({c["index"] for c in multi}) == [0, 1]


async def test_stream_holds_back_incomplete_utf8(client):
    # The tiny tokenizer has no merge for "é": each of its two UTF-8 bytes is its own token, so a cumulative
    # chunk cut between them would end in U+FFFD; SGLang's detokenizer holds such a tail back.
    chunks = [
        c
        async for c in client.stream_generate(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "regex": "(é){3}", "temperature": 1.0}}
        )
    ]
    assert len(chunks) >= 6
    assert all(not c["text"].endswith("\ufffd") for c in chunks)
    assert chunks[-1]["text"] == "ééé"
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, len(chunks) + 1))
    assert all("ééé".startswith(c["text"]) for c in chunks)  # every chunk is a clean prefix of the answer


BAD_INPUTS = [
    (b"{not json", "str", "malformed JSON"),
    (b"", "dict", "JSON body is required"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 4}}, "str", "unknown field `max_tokens`"),
    ({"input_ids": [1], "return_logprob": "yes"}, "str", "Expected `bool`"),
    ({"input_ids": []}, "dict", "cannot be empty"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "dict", "logprob_start_len"),
    ({"input_ids": list(range(3, 100)) * 50, "sampling_params": {"max_new_tokens": 1}}, "dict", "context length"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "dict", "top_p"),
    ({"input_ids": [1], "sampling_params": {"regex": "(unclosed"}}, "dict", "invalid regex"),
    ({"input_ids": [99999]}, "dict", "vocabulary"),
    ({"text": 5}, "str", "Expected"),
]


@pytest.mark.parametrize(("body", "shape", "needle"), BAD_INPUTS)
def test_bad_input_is_a_clear_400(http, body, shape, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = http.post("/generate", **kwargs)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    message = err if shape == "str" else err["message"]
    assert isinstance(message, str) and needle in message


def test_control_endpoints_need_a_json_body(http):
    assert http.post("/pause_generation").status_code == 400
    assert http.post("/update_weights_from_disk", json={}).status_code == 400


async def test_health_stays_responsive_during_long_generation(dev_engine, client):
    long_gen = asyncio.create_task(
        client.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})
    )
    await async_wait_until(
        lambda: metric_value(dev_engine.url, "sglang:num_running_reqs") >= 1, timeout_s=30, interval_s=0.02
    )
    worst = 0.0
    async with httpx.AsyncClient(base_url=dev_engine.url, trust_env=False, timeout=5) as h:
        for _ in range(10):
            t = time.monotonic()
            assert (await h.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - t)
            if long_gen.done():
                break
            await asyncio.sleep(0.05)  # the probe interval: /health is probed across the generation, not in a burst
    was_running = not long_gen.done()
    out = await long_gen
    assert was_running, "generation finished before /health was probed; make it longer"
    assert out["meta_info"]["completion_tokens"] == 1500
    assert worst < 1.0


async def test_concurrent_requests_are_isolated(client):
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    solo = (await client.generate_ids(PROMPT, params))[0]
    results = await asyncio.gather(
        *(client.generate_ids(PROMPT, params) for _ in range(6)),
        *(client.generate_ids(PROMPT[:3], {**params, "temperature": 1.0}) for _ in range(4)),
    )
    for gens in results[:6]:
        assert gens[0].output_ids == solo.output_ids
        assert max(abs(a - b) for a, b in zip(gens[0].output_logprobs, solo.output_logprobs, strict=True)) < 1e-5


async def test_info_endpoints(http):
    info = http.get("/model_info").json()
    assert info["served_model_name"] == "tiny" and info["weight_version"] == "default" and info["is_generation"]
    assert http.get("/get_model_info").json() == info
    server = http.get("/get_server_info").json()
    assert server["tp_size"] == 1 and server["dp_size"] == 1 and server["version"].startswith("0.5.23")
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    assert http.get("/health_generate").status_code == 200
    assert http.post("/flush_cache", json={}).status_code == 200
    assert http.post("/update_weights_from_tensor", json={}).json()["success"] is False


async def test_client_rejects_without_retry(client):
    with pytest.raises(EngineRejected, match="top_p"):
        await client.generate_ids(PROMPT, {"top_p": 2.0})


def test_chat_completions_with_openai_client(dev_engine):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=dev_engine.url + "/v1", api_key="unused", http_client=httpx.Client(trust_env=False))
    msgs = [{"role": "user", "content": "what is the weather?"}]
    resp = oc.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, n=2, logprobs=True, top_logprobs=2, temperature=0.8, seed=3
    )
    assert len(resp.choices) == 2 and resp.usage.completion_tokens >= 2
    for ch in resp.choices:
        assert ch.finish_reason in ("stop", "length") and ch.logprobs.content
        assert all(len(e.top_logprobs) == 2 for e in ch.logprobs.content)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    raw = oc.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=2, tools=tools, extra_body={"return_token_ids": True}
    )
    plain = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body={"return_token_ids": True})
    assert raw.usage.prompt_tokens > plain.usage.prompt_tokens  # tools reached the template
    assert len(raw.choices[0].model_extra["prompt_token_ids"]) == raw.usage.prompt_tokens
    stream = oc.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):
        oc.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, stream_options={"include_usage": True})


def test_chat_bad_input_shapes(http):
    for body in [
        b"{oops",
        {"messages": "hi"},
        {"messages": []},
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "many"},
    ]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        resp = http.post("/v1/chat/completions", **kwargs)
        assert resp.status_code == 400, resp.text
        err = resp.json()
        assert err["object"] == "error" and err["code"] == 400 and err["message"]
    ok = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 2,
            "model": "unknown",
            "logprobs": False,
            "separate_reasoning": True,
            "return_hidden_states": False,
        },
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    assert json.loads(ok.text)["metadata"]["weight_version"] == "default"


def test_chat_parses_reasoning_and_tool_calls(http):
    """Constrained output forces a think block and a tool call; the engine splits them like SGLang's parsers."""
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
    body = {
        "model": "tiny",
        "messages": msgs,
        "tools": tools,
        "max_tokens": 64,
        "seed": 7,
        "regex": r"<think>[a-z]{2,5}</think>" + call,
    }
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert re.fullmatch(r"[a-z]{2,5}", choice["message"]["reasoning_content"])
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    # streamed: reasoning arrives as reasoning_content deltas, the call in the finish-side chunk
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls")] == ["get_weather"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
