"""Client disconnects propagate to the engine (policy_server.api.chat.routes, .generation).

Contract pinned here:
- e2e (policy server -> real sglang-router -> dev engine, aborts sent to the engine WORKER URL): a client that
  hangs up mid-generation (non-streaming once the engine runs the request, streaming after the first chunks) makes the engine's
  ``sglang:num_running_reqs`` drop to 0 within about a second instead of running the 3500-token greedy reply
  (about 2-3 s here) to the end; the worker receives ``POST /abort_request``; the store has no turn for the
  aborted reply, the session's earlier turn is paired with the retried request, and a normal request right
  after works. The non-streaming case is the one where only our abort stops the engine: the dev engine (like a
  proxy that does not forward disconnects) keeps generating a non-streaming request whose client left.
- unit: an abandoned generation is never resumed (weight-sync resume loop), rids are unique per segment with
  one abort prefix; ``abort_engine_requests`` is best effort (404 / hung worker -> logged, never raised, bounded);
  a turn recorded while its client left is rejected with ``client_disconnected`` (awaiting or session-end).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from engine.client import EngineClient, RetryPolicy
from engine.disconnect import abort_engine_requests
from engine.records import TurnRecord
from policy_server.api.chat.routes import DISCONNECT_REASON, _reject_turn
from policy_server.serving.generation import GenerationAbandoned, Generator, GenResult
from policy_server.serving.weight_sync import WeightGate
from policy_server.store import Store
from tests.testkit.procs import metric_value
from tests.testkit.servers import CLIENT_KEY, client
from tests.waiting import wait_until

LONG = 3500  # greedy decoding of the tiny model never samples EOS: always the full length (~2-3 s on the CPU)
DROP_DEADLINE_S = 1.5


# ---------------------------------------------------------------------------------------------- helpers
def running(engine_url: str) -> float:
    return metric_value(engine_url, "sglang:num_running_reqs")


def aborts(engine_url: str) -> float:
    return metric_value(engine_url, "hindsight_dev_engine_http_requests_total", route="/abort_request", status="200")


def wait_running(engine_url: str, *, want_zero: bool, deadline_s: float) -> float:
    """Seconds until the engine runs no request (want_zero) or at least one; fails after the deadline."""
    t0 = time.monotonic()
    wait_until(
        lambda: (running(engine_url) == 0) == want_zero,
        timeout_s=deadline_s,
        interval_s=0.02,
        message=f"engine num_running_reqs {'never dropped to 0' if want_zero else 'stayed 0'}",
    )
    return time.monotonic() - t0


def body(messages: list[dict], *, max_tokens: int, stream: bool = False) -> dict:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def turns_of(policy, sid: str) -> list[dict]:
    st = Store(policy.log_path.parent / "data")
    try:
        out = []
        for i in range(10):
            t = st.get_turn(sid, i)
            if t is not None:
                out.append(t.to_json())
        return out
    finally:
        st.close()


def policy_log(policy) -> str:
    return Path(policy.log_path).read_text(errors="replace")


# ---------------------------------------------------------------------------------------------- e2e
@pytest.mark.e2e
def test_nonstreaming_disconnect_aborts_engine_and_records_nothing(policy, engine):
    sid = "dc-plain"
    hello = [{"role": "user", "content": "hello"}]
    with client(policy.url) as c:  # turn 0: a short normal reply, awaiting its next state
        r0 = c.post("/v1/chat/completions", json=body(hello, max_tokens=4), headers={"X-Session-Id": sid})
    assert r0.status_code == 200, r0.text
    reply0 = r0.json()["choices"][0]["message"]
    msgs = [*hello, {"role": "assistant", "content": reply0["content"]}, {"role": "user", "content": "go on"}]
    assert running(engine.url) == 0
    aborts0 = aborts(engine.url)
    tokens0 = metric_value(engine.url, "sglang:generation_tokens_total")

    async def hang_up() -> float:
        async with httpx.AsyncClient(
            base_url=policy.url, trust_env=False, timeout=30, headers={"Authorization": f"Bearer {CLIENT_KEY}"}
        ) as ac:
            task = asyncio.create_task(
                ac.post("/v1/chat/completions", json=body(msgs, max_tokens=LONG), headers={"X-Session-Id": sid})
            )
            await asyncio.to_thread(wait_running, engine.url, want_zero=False, deadline_s=10)
            assert not task.done(), "the long generation finished before the client could leave"
            task.cancel()  # closes the connection: the client is gone
            await asyncio.gather(task, return_exceptions=True)
            return await asyncio.to_thread(wait_running, engine.url, want_zero=True, deadline_s=DROP_DEADLINE_S)

    dropped_s = asyncio.run(hang_up())
    assert aborts(engine.url) >= aborts0 + 1, "the worker never received /abort_request"
    # the engine stopped early: far fewer tokens than the reply it was asked for (it would have produced all)
    produced = metric_value(engine.url, "sglang:generation_tokens_total") - tokens0
    assert produced < 0.8 * LONG, f"engine produced {produced} tokens after the client left ({dropped_s:.2f}s)"
    assert re.search(r"aborting engine requests hs-[0-9a-f]{32}-\*", policy_log(policy))

    # nothing of the aborted reply is in the store: turn 0 still awaits, there is no turn 1
    assert [t["turn_index"] for t in turns_of(policy, sid)] == [0]
    # the client retries the same turn: it works, pairs turn 0 with "go on", and is recorded as turn 1
    with client(policy.url) as c:
        r1 = c.post("/v1/chat/completions", json=body(msgs, max_tokens=4), headers={"X-Session-Id": sid})
    assert r1.status_code == 200, r1.text
    turns = turns_of(policy, sid)
    assert [t["turn_index"] for t in turns] == [0, 1]
    assert turns[0]["pairing"] == "paired" and turns[0]["next_state"] == [{"role": "user", "content": "go on"}]
    assert len(turns[1]["response_ids"]) == r1.json()["usage"]["completion_tokens"] <= 4
    assert running(engine.url) == 0


@pytest.mark.e2e
def test_streaming_disconnect_after_first_chunks_aborts_engine(policy, engine):
    sid = "dc-stream"
    msgs = [{"role": "user", "content": "tell me a long story"}]
    aborts0 = aborts(engine.url)
    chunks = 0
    with client(policy.url) as c:
        with c.stream(
            "POST", "/v1/chat/completions", json=body(msgs, max_tokens=LONG, stream=True), headers={"X-Session-Id": sid}
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    chunks += 1
                if chunks >= 4:
                    assert '"finish_reason": null' in line
                    assert running(engine.url) == 1, "the generation should still be running when the client leaves"
                    break  # leaving iter_lines closes the unfinished response: the connection drops mid-stream
    dropped_s = wait_running(engine.url, want_zero=True, deadline_s=DROP_DEADLINE_S)
    wait_until(
        lambda: aborts(engine.url) >= aborts0 + 1,
        timeout_s=5,
        message=f"no /abort_request reached the worker (drop {dropped_s:.2f}s)",
    )
    assert turns_of(policy, sid) == [], "an undelivered streamed reply was recorded"
    # a normal streamed request right after still works and is recorded
    with client(policy.url) as c:
        with c.stream(
            "POST", "/v1/chat/completions", json=body(msgs, max_tokens=6, stream=True), headers={"X-Session-Id": sid}
        ) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(lines)
    assert [len(t["response_ids"]) for t in turns_of(policy, sid)] == [6]


# ---------------------------------------------------------------------------------------------- unit
def _abort_then_done_engine(calls: list[dict], on_call=None) -> EngineClient:
    """A fake /generate: the first submission comes back aborted after 2 tokens, the next one finishes."""

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        payload = json.loads(request.content)
        calls.append(payload)
        if on_call:
            on_call()
        aborted = len(calls) == 1
        ids = [5, 6] if aborted else [7]
        finish = {"type": "abort", "message": "Aborted"} if aborted else {"type": "stop", "matched": 7}
        return httpx.Response(
            200,
            json={
                "text": "ab" if aborted else "c",
                "output_ids": ids,
                "meta_info": {
                    "id": payload.get("rid"),
                    "finish_reason": finish,
                    "weight_version": "v0",
                    "output_token_logprobs": [[-0.5, t, None] for t in ids],
                },
            },
        )

    return EngineClient("http://engine", transport=httpx.MockTransport(handler), retry=RetryPolicy(max_attempts=1))


@pytest.mark.unit
async def test_abort_is_resumed_for_weight_sync_but_never_after_the_client_left():
    calls: list[dict] = []
    gen = Generator(_abort_then_done_engine(calls), tokenizer=None, gate=WeightGate(5.0, "v0"))
    res = await gen.generate([1, 2], {"max_new_tokens": 8}, GenResult(prompt_ids=[1, 2], rid_prefix="hs-ab-"))
    assert res.response_ids == [5, 6, 7] and res.resumes == 1  # a pause abort is resumed...
    assert [c["rid"] for c in calls] == ["hs-ab-0", "hs-ab-1"]  # ...with a fresh rid under the same prefix
    assert calls[1]["input_ids"] == [1, 2, 5, 6] and calls[1]["sampling_params"]["max_new_tokens"] == 6

    calls.clear()
    res = GenResult(prompt_ids=[1, 2], rid_prefix="hs-cd-")
    # the client leaves while the engine call is in flight; the abort that comes back is ours
    gen = Generator(
        _abort_then_done_engine(calls, on_call=lambda: setattr(res, "abandoned", True)),
        tokenizer=None,
        gate=WeightGate(5.0, "v0"),
    )
    with pytest.raises(GenerationAbandoned):
        await gen.generate([1, 2], {"max_new_tokens": 8}, res)
    assert [c["rid"] for c in calls] == ["hs-cd-0"]  # never resubmitted
    with pytest.raises(GenerationAbandoned):
        res.next_rid()


@pytest.mark.unit
async def test_abort_engine_requests_is_best_effort_and_bounded():
    seen: list[tuple[str, dict]] = []

    def ok(request: httpx.Request) -> httpx.Response:
        import json

        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200)

    async def hangs(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200)

    workers = [
        EngineClient("http://w1", transport=httpx.MockTransport(ok)),
        EngineClient("http://router", transport=httpx.MockTransport(lambda r: httpx.Response(404))),
        EngineClient("http://w3", transport=httpx.MockTransport(hangs)),
    ]
    t0 = time.monotonic()
    acked = await abort_engine_requests(workers, "hs-ff-", timeout_s=0.3)
    # Bounded by timeout_s (0.3 s) plus generous scheduling slack, far below the hanging worker's 30 s.
    assert acked == 1 and time.monotonic() - t0 < 0.3 + 3.0
    assert seen == [("http://w1/abort_request", {"rid": "hs-ff-", "abort_all": False})]


@pytest.mark.unit
def test_turn_recorded_as_the_client_left_is_rejected(tmp_path: Path):
    st = Store(tmp_path)
    rec = {
        "messages": [{"role": "user", "content": "hi"}],
        "prompt_ids": [1],
        "response_ids": [2],
        "rollout_logprobs": [-0.1],
        "response": {"content": "x"},
    }
    try:
        idx = st.record_turn("s1", TurnRecord.model_validate(rec), session_done=False)  # awaiting its next state
        assert _reject_turn(st, "s1", idx) == "rejected"
        assert st.get_turn("s1", idx).pairing == "mismatch"
        assert st.awaiting_turn("s1") is None  # the next request starts a fresh pairing
        idx2 = st.record_turn(
            "s2", TurnRecord.model_validate(rec), session_done=True
        )  # the request ended its session: pending_judge
        assert _reject_turn(st, "s2", idx2) == "rejected"
        rows = st.list_samples(session_id="s1") + st.list_samples(session_id="s2")
        assert [(r.status, r.reject_reason) for r in rows] == [("rejected", DISCONNECT_REASON)] * 2
        assert _reject_turn(st, "s2", idx2) == "already decided"  # idempotent
    finally:
        st.close()
