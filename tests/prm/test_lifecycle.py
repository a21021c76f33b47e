"""Runner lifecycle: create() rollback of owned scorers (incl. notes and cancellation),
aclose() reverse order / at most once / concurrent waiters / ExceptionGroup / no retry after interruption,
borrowed scorers never closed, run() rejected once closing starts, sync constructor kept."""

from __future__ import annotations

import asyncio

import pytest

from prm import PRMConfigError, PRMRunner, PRMRunnerClosed, score_session
from tests.prm.prm_test_scorers import A, C, make_turns
from tests.waiting import async_wait_until

pytestmark = pytest.mark.unit


def spec(cls: str, **kwargs) -> dict:
    enabled = kwargs.pop("enabled", True)
    return {"path": f"tests.prm.prm_test_scorers.{cls}", "enabled": enabled, "kwargs": kwargs}


def closes(log) -> list[str]:
    return [name for event, name in log if event == "close_start"]


async def closing_started(log, name: str) -> None:
    """Wait until scorer ``name``'s close hook has started (it then sleeps for its close_delay_s)."""
    await async_wait_until(lambda: name in closes(log), timeout_s=5, interval_s=0.001)


async def test_aclose_reverse_order_owned_only_disabled_included(scorer_log):
    borrowed = C()
    runner = await PRMRunner.create({"scorers": [spec("A"), borrowed, spec("B", enabled=False), spec("D")]})
    assert [s.name for s in runner.scorers] == ["a", "c", "b", "d"]
    assert runner.owns(runner.scorers[0]) and not runner.owns(borrowed)
    await runner.aclose()
    assert closes(scorer_log) == ["d", "b", "a"]  # reverse creation order; borrowed c untouched


async def test_aclose_at_most_once(scorer_log):
    runner = await PRMRunner.create({"scorers": [spec("A"), spec("B")]})
    await runner.aclose()
    await runner.aclose()
    assert closes(scorer_log) == ["b", "a"]


async def test_concurrent_aclose_waits_for_the_same_cleanup(scorer_log):
    runner = await PRMRunner.create({"scorers": [spec("A", close_delay_s=0.05), spec("B", close_delay_s=0.05)]})
    first = asyncio.create_task(runner.aclose())
    await closing_started(scorer_log, "b")  # first caller is inside b's hook
    second = asyncio.create_task(runner.aclose())
    await asyncio.sleep(0)
    assert not second.done()  # waits instead of returning early
    await asyncio.gather(first, second)
    assert closes(scorer_log) == ["b", "a"]
    assert ("closed", "a") in scorer_log and ("closed", "b") in scorer_log


async def test_cleanup_failures_raised_together_after_all_attempted(scorer_log):
    runner = await PRMRunner.create({"scorers": [spec("A", fail_close=True), spec("B"), spec("C", fail_close=True)]})
    with pytest.raises(ExceptionGroup, match="PRM scorer cleanup failed") as info:
        await runner.aclose()
    assert [str(e) for e in info.value.exceptions] == ["c cleanup failed", "a cleanup failed"]
    assert closes(scorer_log) == ["c", "b", "a"]
    # A later call reports the same outcome but never retries a failed hook.
    with pytest.raises(ExceptionGroup):
        await runner.aclose()
    assert closes(scorer_log) == ["c", "b", "a"]


async def test_cancelled_cleanup_propagates_and_is_not_retried(scorer_log):
    runner = await PRMRunner.create({"scorers": [spec("A"), spec("B", close_delay_s=5.0)]})
    task = asyncio.create_task(runner.aclose())
    await closing_started(scorer_log, "b")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await runner.aclose()  # finishes the rest, does not rerun b's interrupted hook
    assert closes(scorer_log) == ["b", "a"]
    assert ("closed", "b") not in scorer_log and ("closed", "a") in scorer_log


async def test_run_rejected_once_closing_starts(scorer_log):
    runner = await PRMRunner.create({"scorers": [spec("A", close_delay_s=0.05)]})
    closing = asyncio.create_task(runner.aclose())
    await closing_started(scorer_log, "a")
    with pytest.raises(PRMRunnerClosed):
        await score_session(runner, make_turns(1))
    await closing
    with pytest.raises(PRMRunnerClosed):
        await score_session(runner, make_turns(1))


async def test_create_rolls_back_owned_scorers_and_reraises_original(scorer_log):
    borrowed = C()
    with pytest.raises(RuntimeError, match="d constructor failed") as info:
        await PRMRunner.create(
            {"scorers": [spec("A"), borrowed, spec("B", fail_close=True), spec("D", fail_init=True)]}
        )
    assert closes(scorer_log) == ["b", "a"]  # reverse order, borrowed c not closed, d never built
    assert any("cleanup of PRM scorer 'b' failed" in n for n in info.value.__notes__)


@pytest.mark.parametrize(
    "bad_entry, advantage_mode, match, expected_closes",
    [
        ({"path": "tests.prm.prm_test_scorers.Missing"}, "additive", "not a BaseScorer subclass", ["b", "a"]),
        ({"path": "no_such_module_xyz.Scorer"}, "additive", "cannot import PRM scorer module", ["b", "a"]),
        ({"path": "tests.prm.prm_test_scorers.NotAScorer"}, "additive", "not a BaseScorer subclass", ["b", "a"]),
        # Validation runs after every scorer was built, so the offender is owned and rolled back too.
        ({"path": "tests.prm.prm_test_scorers.AlsoNamedA"}, "additive", "share the name 'a'", ["a", "b", "a"]),
        (
            {"path": "tests.prm.prm_test_scorers.RejectsProcessWeighted"},
            "process_weighted",
            "cannot be used with process_weighted",
            ["rejects_pw", "b", "a"],
        ),
    ],
)
async def test_create_rolls_back_on_resolution_and_validation_errors(
    scorer_log, bad_entry, advantage_mode, match, expected_closes
):
    config = {"scorers": [spec("A"), spec("B"), bad_entry], "advantage_shaping": {"mode": advantage_mode}}
    with pytest.raises((PRMConfigError, ValueError), match=match):
        await PRMRunner.create(config)
    assert closes(scorer_log) == expected_closes


async def test_cancellation_during_rollback_propagates(scorer_log):
    config = {"scorers": [spec("A"), spec("B", close_delay_s=5.0), spec("C", fail_init=True)]}
    task = asyncio.create_task(PRMRunner.create(config))
    await closing_started(scorer_log, "b")
    assert closes(scorer_log) == ["b"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_sync_constructor_kept_without_rollback(scorer_log):
    runner = PRMRunner({"scorers": [spec("A")]})
    assert [s.name for s in runner.scorers] == ["a"]
    with pytest.raises(RuntimeError, match="b constructor failed"):
        PRMRunner({"scorers": [spec("A"), spec("B", fail_init=True)]})
    assert closes(scorer_log) == []  # documented: no async rollback from the sync constructor
    asyncio.run(runner.aclose())
    assert closes(scorer_log) == ["a"]


async def test_borrowed_scorer_survives_runner_close(scorer_log):
    shared = A()
    r1 = await PRMRunner.create({"scorers": [shared]})
    await r1.aclose()
    r2 = await PRMRunner.create({"scorers": [shared]})
    assert await score_session(r2, make_turns(1)) == {0: [1.0, 1.0]}
    await r2.aclose()
    assert closes(scorer_log) == []
