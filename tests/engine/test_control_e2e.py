"""Control plane and auth of the dev engine, end to end, on an engine of its own (its weights change here).

Contract (SGLang's control endpoints): update_weights_from_disk reloads weights (outputs change) and reports
the given weight_version; pause_generation mode abort ends in-flight requests with HTTP 200, partial
output and an abort finish_reason, new requests wait until continue_generation; in_place holds requests
until continue; abort_request matches rid prefixes; admin endpoints need the admin key, health stays open.
A test that changes the weights puts the original ones back in ``finally``, so a failed assert cannot leave
the next test on other weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from engine.client import EngineClient, RetryPolicy
from engine.errors import EngineRejected
from tests.testkit.procs import ManagedProcess, metric_value, start_dev_engine
from tests.testkit.servers import ADMIN_KEY
from tests.testkit.servers import ENGINE_KEY as API_KEY
from tests.waiting import async_wait_until

pytestmark = pytest.mark.e2e

PROMPT = [75, 72, 79, 524, 300, 301]
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir, tmp_path_factory) -> Iterator[ManagedProcess]:
    mp = start_dev_engine(
        tiny_model_dir,
        log_dir=tmp_path_factory.mktemp("control-logs"),
        api_key=API_KEY,
        extra_args=["--admin-api-key", ADMIN_KEY],
    )
    yield mp
    mp.stop()


@pytest.fixture
async def client(keyed_engine):
    async with EngineClient(
        keyed_engine.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, retry=RetryPolicy(max_attempts=2, deadline_s=60)
    ) as c:
        yield c
        await c.continue_generation()  # never leave the module's engine paused


async def wait_running(client: EngineClient, url: str) -> None:
    """Wait until the engine has a request in flight (flush_cache refuses while requests run)."""
    async with httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as h:

        async def busy() -> bool:
            return (await h.get(url + "/flush_cache")).status_code == 400

        await async_wait_until(busy, timeout_s=10, interval_s=0.02, message="request never started")


async def wait_requests(url: str, *, running: int = 0, queued: int = 0) -> None:
    """Wait until the engine counts at least ``running`` prompts past admission and ``queued`` waiting for it."""
    await async_wait_until(
        lambda: (
            metric_value(url, "sglang:num_running_reqs") >= running
            and metric_value(url, "sglang:num_queue_reqs") >= queued
        ),
        timeout_s=30,
        interval_s=0.02,
        message=f"engine never had {running} running / {queued} queued request(s)",
    )


def test_auth_rules(keyed_engine):
    with httpx.Client(base_url=keyed_engine.url, trust_env=False, timeout=30) as h:
        assert h.get("/health").status_code == 200
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        assert h.post("/generate", json=body).status_code == 401
        assert h.post("/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        user = {"Authorization": f"Bearer {API_KEY}"}
        assert h.post("/pause_generation", json={}, headers=user).status_code == 401  # api key is not admin
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert h.post("/continue_generation", json={}, headers=admin).status_code == 200
        assert h.get("/model_info", headers=user).status_code == 200


async def test_update_weights_changes_outputs_and_version(client, other_model_dir, tiny_model_dir):
    greedy = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    before = (await client.generate_ids(PROMPT, greedy))[0]
    version0 = await client.weight_version()
    try:
        result = await client.update_weights_from_disk(str(other_model_dir), weight_version="step-1")
        assert result["success"] is True and result["num_paused_requests"] == 0 and "message" in result
        after = (await client.generate_ids(PROMPT, greedy))[0]
        assert after.weight_version == "step-1" and await client.weight_version() == "step-1"
        assert after.output_ids != before.output_ids or after.output_logprobs != before.output_logprobs
        info = await client.model_info()
        assert info["model_path"] == str(other_model_dir)
        # without weight_version the version stays (SGLang); the original weights give the original outputs back
        await client.update_weights_from_disk(str(tiny_model_dir))
        restored = (await client.generate_ids(PROMPT, greedy))[0]
        assert restored.output_ids == before.output_ids and restored.weight_version == "step-1"
        with pytest.raises(EngineRejected, match="not a local model folder"):
            await client.update_weights_from_disk("/nonexistent/model")
    finally:
        await client.update_weights_from_disk(str(tiny_model_dir), weight_version=version0)


async def test_pause_abort_returns_partial_output_and_blocks_new_requests(client, keyed_engine):
    running = asyncio.create_task(client.generate_ids(PROMPT, LONG, rid="victim-1"))
    await wait_running(client, keyed_engine.url)
    # Kept: decode time, so the victim has some output to cut; nothing exposes a request's progress before it ends.
    await asyncio.sleep(0.1)
    await client.pause_generation("abort")
    gen = (await asyncio.wait_for(running, 30))[0]
    assert gen.aborted and gen.finish_reason["status_code"] is None and "message" in gen.finish_reason
    assert 0 < len(gen.output_ids) < LONG["max_new_tokens"] and len(gen.output_logprobs) == len(gen.output_ids)
    waiting = asyncio.create_task(client.generate_ids(PROMPT, {"max_new_tokens": 2}))
    await wait_requests(keyed_engine.url, queued=1)
    assert not waiting.done()  # admission waits while paused
    await client.continue_generation()
    done = (await asyncio.wait_for(waiting, 30))[0]
    assert not done.aborted and len(done.output_ids) <= 2


async def test_pause_in_place_holds_until_continue(client, keyed_engine):
    held = asyncio.create_task(client.generate_ids(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}))
    await wait_running(client, keyed_engine.url)
    await client.pause_generation("in_place")
    await asyncio.sleep(0.5)  # kept: the behaviour under test is that nothing finishes during this window
    assert not held.done()
    await client.continue_generation()
    gen = (await asyncio.wait_for(held, 60))[0]
    assert gen.finish_reason == {"type": "length", "length": 400} and len(gen.output_ids) == 400


async def test_retract_pause_lets_weights_update_under_held_requests(
    client, keyed_engine, other_model_dir, tiny_model_dir
):
    held = asyncio.create_task(client.generate_ids(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}))
    await wait_running(client, keyed_engine.url)
    await client.pause_generation("retract")
    try:
        result = await client.update_weights_from_disk(str(other_model_dir), weight_version="retracted")
        assert result["num_paused_requests"] == 1
        await client.continue_generation()
        gen = (await asyncio.wait_for(held, 60))[0]
        assert len(gen.output_ids) == 400 and gen.weight_version == "retracted"
    finally:
        await client.continue_generation()
        await client.update_weights_from_disk(str(tiny_model_dir), weight_version="default")


async def test_abort_request_by_rid_prefix(client, keyed_engine):
    victim = asyncio.create_task(
        client.generate({"input_ids": [PROMPT, PROMPT], "rid": "job42", "sampling_params": LONG})
    )
    bystander = asyncio.create_task(
        client.generate_ids(PROMPT, {"max_new_tokens": 300, "ignore_eos": True}, rid="other")
    )
    await wait_requests(keyed_engine.url, running=3)  # both job42 prompts and the bystander are past admission
    await client.abort_request("job42")
    items = await asyncio.wait_for(victim, 30)
    assert [i["meta_info"]["finish_reason"]["type"] for i in items] == ["abort", "abort"]
    assert [i["meta_info"]["id"] for i in items] == ["job42_0", "job42_1"]
    assert not (await asyncio.wait_for(bystander, 60))[0].aborted
