"""Replica state shared through one PostgreSQL store, without servers (policy_server.serving.replicas, sessions).

Contract: the idle sweep of a replica leaves alone a session with a main request in flight at another live
replica (published in its heartbeat), and ends it once that request is gone; a replica that stopped beating
no longer protects anything; a pause announced by one replica closes the other's gate once it refreshed, and
the announcer waits for that acknowledgement."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.records import TurnRecord
from policy_server.rewards.modes import ModeState
from policy_server.serving.replicas import ReplicaBeat, ReplicaSync
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.weight_sync import WeightGate
from policy_server.store import open_store
from tests.waiting import async_wait_until

pytestmark = pytest.mark.unit


def _record() -> dict:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "response": {"content": "x"},
        "prompt_ids": [1],
        "response_ids": [2],
        "rollout_logprobs": [-0.1],
    }


async def test_sweep_spares_a_session_in_flight_at_another_replica(pg_url):
    a, b = open_store(pg_url, ""), open_store(pg_url, "")
    try:
        busy: list[str] = ["s"]
        sync_a = ReplicaSync(a, replica_id="A", mode_state=ModeState(), gate=WeightGate(5.0), interval_s=0.5)
        sync_b = ReplicaSync(
            b,
            replica_id="B",
            mode_state=ModeState(),
            gate=WeightGate(5.0),
            interval_s=0.5,
            in_flight=lambda: list(busy),
        )
        tracker_a = SessionTracker(a, idle_timeout_s=10.0)
        tracker_a.remote_in_flight = sync_a.remote_in_flight
        a.record_turn(
            "s", TurnRecord.model_validate(_record()), session_done=False, now=time.time() - 60
        )  # idle for a minute
        await sync_b.refresh()  # B's heartbeat: a request of "s" is being generated there
        assert await tracker_a.sweep_idle() == 0 and a.session("s").done == 0
        busy.clear()
        await sync_b.refresh()
        assert await tracker_a.sweep_idle() == 1 and a.session("s").done == 1
    finally:
        a.close()
        b.close()


async def test_a_silent_replica_protects_nothing(pg_url):
    a = open_store(pg_url, "")
    try:
        a.set_runtime("replica:dead", ReplicaBeat(at=time.time() - 60, in_flight=["s"]))
        sync_a = ReplicaSync(a, replica_id="A", mode_state=ModeState(), gate=WeightGate(5.0), interval_s=0.5)
        assert await sync_a.remote_in_flight() == set()
    finally:
        a.close()


async def test_pause_is_acknowledged_before_the_engines_pause(pg_url):
    a, b = open_store(pg_url, ""), open_store(pg_url, "")
    try:
        gate_b = WeightGate(5.0, version="v0")
        sync_a = ReplicaSync(
            a, replica_id="A", mode_state=ModeState(), gate=WeightGate(5.0, version="v0"), interval_s=0.5
        )
        sync_b = ReplicaSync(b, replica_id="B", mode_state=ModeState(), gate=gate_b, interval_s=0.5)
        b.on_admin = sync_b.wake  # B's store listener: NOTIFY hindsight_admin -> refresh
        runner = asyncio.create_task(sync_b.run())
        await sync_b.refresh()  # B is live
        epoch = await asyncio.wait_for(sync_a.announce_pause(), 10)
        assert not gate_b.is_open  # acknowledged means held: B's gate closed before A goes on
        sync_a.gate.version = "v1"
        await sync_a.announce_done(epoch)
        await async_wait_until(
            lambda: gate_b.is_open and gate_b.version == "v1",
            timeout_s=10,
            interval_s=0.02,
            message="B did not reopen with the new version",
        )
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    finally:
        a.close()
        b.close()
