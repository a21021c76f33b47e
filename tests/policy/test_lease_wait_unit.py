"""The lease wait without servers: a real Store (each test on SQLite and on PostgreSQL), the in-process ReadyNotifier and ``lease_when_ready``.

Contract (policy_server.store.ready_notifier, policy_server.store.leases, policy_server.store.samples): a waiter sleeps until a store write
makes a sample ready (judge outcome, session scoring, lease expiry) and is woken by that write, not by a
poll; ``min_n`` holds the lease until enough samples are ready, the deadline hands out whatever is ready;
unusable rewards / teacher log-probs / token rewards are rejected before they can be leased.

"Woken by the write" is checked by what ``notifier.wait`` returned (True: a notification, False: its timeout),
not by a stopwatch; the wall-clock bounds that remain are generous (``SLACK_S`` of scheduling on a loaded
2-core machine) and far below the timeouts they tell apart. Wake latency is a speed figure, printed here."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from engine.records import Sample, TurnRecord
from policy_server.store import Store
from policy_server.store.ready_notifier import LocalReadyNotifier, lease_when_ready
from policy_server.store.records import ScoredSample
from tests.waiting import async_wait_until

# Scheduling delay a loaded 2-core machine may add to any wake-up; every bound using it stays well below the
# wait it is told apart from (wait_s=10 or more), so the assertion still fails if the waiter slept until then.
SLACK_S = 3.0


def _record() -> dict:
    return {"prompt_ids": [1, 2], "response_ids": [3], "rollout_logprobs": [-0.5], "messages": []}


def _judged_later(store: Store, sid: str, data: dict | None = None) -> str:
    """A session's only turn, resolved and waiting for its judge (pending_judge); returns its sample id."""
    store.record_turn(sid, TurnRecord.model_validate(_record()), session_done=True)
    [job] = [j for j in store.pending_jobs() if j.session_id == sid]
    return job.sample_id


def _ready(store: Store, sample_id: str, **data) -> bool:
    return store.complete_judge(
        sample_id, status="ready", reject_reason=None, included=True, data=Sample(sample_id=sample_id, **data)
    )


def _wired(store_factory) -> tuple[Store, LocalReadyNotifier]:
    store = store_factory()
    notifier = LocalReadyNotifier()
    store.on_ready = notifier.notify
    return store, notifier


class _WaitSpy:
    """The notifier as ``lease_when_ready`` sees it; ``waiting`` is set once the waiter sleeps in ``wait``,
    so a test can act exactly then (a poll would be mid-interval) instead of guessing with a sleep;
    ``returned`` lists what each wait returned (True: woken by a notification, False: timed out)."""

    def __init__(self, inner: LocalReadyNotifier) -> None:
        self.inner, self.waiting = inner, threading.Event()
        self.returned: list[bool] = []

    def generation(self) -> int:
        return self.inner.generation()

    def notify(self) -> None:
        self.inner.notify()

    async def wait(self, seen: int, timeout_s: float) -> bool:
        self.waiting.set()  # no await before inner.wait parks: a notification cannot slip in between
        woken = await self.inner.wait(seen, timeout_s)
        self.returned.append(woken)
        return woken


def test_notifier_generation_is_never_missed():
    async def main() -> None:
        n = LocalReadyNotifier()
        seen = n.generation()
        assert await n.wait(seen, 0.05) is False  # nothing happened: times out
        n.notify()
        await asyncio.sleep(0)  # notify from the loop's own thread is scheduled, like from a worker thread
        assert n.generation() == seen + 1
        t0 = time.monotonic()
        assert await n.wait(seen, 5.0) is True  # a notification after `seen`: at once (False would be the timeout)
        assert time.monotonic() - t0 < 5.0 / 2  # generous: only says it did not sit out the 5 s

    asyncio.run(main())


def test_a_ready_sample_wakes_the_waiter(store_factory):
    async def main() -> None:
        store, notifier = _wired(store_factory)
        sid = _judged_later(store, "s")
        marks: dict[str, float] = {}
        spy = _WaitSpy(notifier)

        def judge() -> None:
            assert spy.waiting.wait(5), "the waiter never slept in notifier.wait"
            _ready(store, sid)
            marks["ready"] = time.monotonic()

        th = threading.Thread(target=judge)
        th.start()
        got = await lease_when_ready(store, spy, max_n=8, min_n=1, wait_s=10, lease_s=60)
        marks["leased"] = time.monotonic()
        th.join()
        assert got is not None and [s.sample_id for s in got[1]] == [sid]
        latency_s = marks["leased"] - marks["ready"]
        print(f"wake latency {latency_s * 1000:.1f} ms")
        # Every sleep ended by a notification (the judge's write; on PostgreSQL the listener may add one on
        # connecting), none by the 10 s timeout.
        assert spy.returned and all(spy.returned)
        assert latency_s < SLACK_S

    asyncio.run(main())


def test_min_holds_until_enough_are_ready_and_deadline_gives_what_is_there(store_factory):
    async def main() -> None:
        store, notifier = _wired(store_factory)
        a, b, c = (_judged_later(store, s) for s in "abc")
        _ready(store, a)
        loop = asyncio.get_running_loop()
        spy = _WaitSpy(notifier)
        waiter = asyncio.create_task(lease_when_ready(store, spy, max_n=8, min_n=2, wait_s=10, lease_s=60))
        await async_wait_until(spy.waiting.is_set, timeout_s=5, interval_s=0.01)
        assert not waiter.done()  # one ready, two needed: it looked and went to sleep
        t0 = time.monotonic()
        await loop.run_in_executor(None, _ready, store, b)
        lease_id, samples = await asyncio.wait_for(waiter, 2 * SLACK_S)
        assert {s.sample_id for s in samples} == {a, b}
        assert spy.returned and all(spy.returned) and time.monotonic() - t0 < SLACK_S  # woken by b's write
        # deadline: min 2 with only one ready -> that one, at wait_s
        _ready(store, c)
        t0 = time.monotonic()
        got = await lease_when_ready(store, notifier, max_n=8, min_n=2, wait_s=0.5, lease_s=60)
        assert got is not None and [s.sample_id for s in got[1]] == [c]
        assert 0.45 <= time.monotonic() - t0 < 0.5 + SLACK_S  # not before the deadline
        # nothing ready at all: None at the deadline
        t0 = time.monotonic()
        assert await lease_when_ready(store, notifier, max_n=8, min_n=1, wait_s=0.3, lease_s=60) is None
        assert 0.25 <= time.monotonic() - t0 < 0.3 + SLACK_S

    asyncio.run(main())


def test_an_expiring_lease_wakes_the_waiter(store_factory):
    async def main() -> None:
        store, notifier = _wired(store_factory)
        sid = _judged_later(store, "s")
        _ready(store, sid)
        first = store.lease(8, lease_s=0.4)
        assert first is not None
        t0 = time.monotonic()
        got = await lease_when_ready(store, notifier, max_n=8, min_n=1, wait_s=30, lease_s=60)
        assert got is not None and [s.sample_id for s in got[1]] == [sid]
        assert time.monotonic() - t0 < 0.4 + SLACK_S  # back at the first lease's deadline, not at wait_s (30 s)

    asyncio.run(main())


def test_concurrent_waiters_get_disjoint_samples(store_factory):
    async def main() -> None:
        store, notifier = _wired(store_factory)
        ids = [_judged_later(store, f"s{i}") for i in range(4)]
        waiters = [
            asyncio.create_task(lease_when_ready(store, notifier, max_n=2, min_n=2, wait_s=10, lease_s=60))
            for _ in range(2)
        ]
        loop = asyncio.get_running_loop()
        for sid in ids:  # arriving one at a time
            await loop.run_in_executor(None, _ready, store, sid)
        got = await asyncio.wait_for(asyncio.gather(*waiters), 5)
        leased = [[s.sample_id for s in g[1]] for g in got]
        assert sorted(leased[0] + leased[1]) == sorted(ids) and not set(leased[0]) & set(leased[1])

    asyncio.run(main())


@pytest.mark.parametrize(
    "data, why",
    [
        ({"reward": math.nan}, "reward is not a finite number"),
        ({"reward": math.inf}, "reward is not a finite number"),
        ({"reward": 1.0, "teacher_logprobs": [-0.1, math.nan]}, "teacher_logprobs holds a non-finite"),
        ({"teacher_logprobs": [-0.1, 0.5]}, "teacher_logprobs holds a positive"),
        ({"token_rewards": [0.1, math.nan]}, "token_rewards holds a non-finite"),
        ({"teacher_topk": {"ids": [[1]], "logprobs": [[math.inf]]}}, "teacher_topk.logprobs holds a non-finite"),
    ],
)
def test_unusable_values_are_rejected_before_they_can_be_leased(store_factory, data, why):
    store, notified = store_factory(), []
    store.on_ready = lambda: notified.append(1)
    sid = _judged_later(store, "s")
    assert _ready(store, sid, **data)
    [row] = store.list_samples(session_id="s", status=None, limit=10)
    assert row.status == "rejected" and (row.reject_reason or "").startswith(f"invalid_values: {why}")
    assert store.lease(8, 60) is None and notified == []  # never leasable, nobody woken


def test_session_scoring_with_a_nan_token_reward_is_rejected(store_factory):
    store = store_factory()
    good, bad = _judged_later(store, "g"), _judged_later(store, "b")
    for sid in (good, bad):
        store.complete_judge(
            sid, status="pending_score", reject_reason=None, included=True, data=Sample(sample_id=sid, reward=1.0)
        )
    assert (
        store.complete_score(
            [
                ScoredSample(good, "ready", None, Sample(sample_id=good, token_rewards=[0.5])),
                ScoredSample(bad, "ready", None, Sample(sample_id=bad, token_rewards=[math.nan])),
            ]
        )
        == 2
    )
    statuses = {r.sample_id: (r.status, r.reject_reason) for r in store.list_samples(limit=10)}
    assert statuses[good] == ("ready", None)
    assert statuses[bad][0] == "rejected" and statuses[bad][1].startswith("invalid_values: token_rewards")
