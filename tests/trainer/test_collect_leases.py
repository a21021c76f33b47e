"""``collect_leases`` (trainer/lease_client/client.py): how a trainer step gathers live traffic.

Contract: lease until at least ``min_batch`` samples are held or the wait ends, never more than
``batch_size`` in all; each call asks the server for the REMAINING min and max; partial leases are held
(returned to the step, acked after its checkpoint) and the wait is capped at half the lease timeout once
something is held; an empty wait gives [] (no step); a dry finite source ends with what is held."""

from __future__ import annotations

import time

import pytest

from engine.records import WeightsPushed
from trainer.lease_client import Lease, SourceExhausted, collect_leases


class ScriptedSource:
    """Answers each lease call with the next scripted (samples, lease_timeout_s); records the calls."""

    def __init__(self, script: list[int | None], lease_timeout_s: float | None = 600.0, sleep_s: float = 0.0):
        self.script, self.timeout_s, self.sleep_s, self.calls = list(script), lease_timeout_s, sleep_s, []

    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease:
        self.calls.append((max_samples, min_samples, round(wait_s, 1)))
        if not self.script:
            raise SourceExhausted("dry")
        n = self.script.pop(0)
        if n is None:
            time.sleep(min(wait_s, self.sleep_s))  # the server waited and nothing came
            return Lease("", [], lease_timeout_s=self.timeout_s)
        return Lease(
            f"L{len(self.calls)}",
            [{"sample_id": f"{len(self.calls)}-{i}"} for i in range(n)],
            lease_timeout_s=self.timeout_s,
        )


def test_one_lease_that_meets_min_is_the_step():
    src = ScriptedSource([4])
    got = collect_leases(src, batch_size=8, min_batch=4, wait_s=30)
    assert [len(x.samples) for x in got] == [4] and src.calls == [(8, 4, 30.0)]


def test_partial_leases_are_held_and_the_remainder_asked_for():
    src = ScriptedSource([1, 2, 3])
    got = collect_leases(src, batch_size=8, min_batch=5, wait_s=30)
    assert [x.lease_id for x in got] == ["L1", "L2", "L3"]
    assert [(c[0], c[1]) for c in src.calls] == [(8, 5), (7, 4), (5, 2)]


def test_an_empty_wait_is_no_step():
    src = ScriptedSource([None], sleep_s=0.2)
    assert collect_leases(src, batch_size=8, min_batch=4, wait_s=0.2) == []
    assert len(src.calls) == 1


# The scripted empty answers below would last 50 * sleep_s if the wait were ignored; the checks read the calls
# the source saw (how long each was told to wait, how many came), and the wall clock only with SLACK_S of
# scheduling that a loaded 2-core machine may add.
SLACK_S = 3.0


def test_the_wait_ends_with_what_is_held():
    src = ScriptedSource([2] + [None] * 50, sleep_s=0.15)
    t0 = time.monotonic()
    got = collect_leases(src, batch_size=8, min_batch=4, wait_s=0.3)
    assert [len(x.samples) for x in got] == [2]
    assert src.calls[0][2] == 0.3 and len(src.calls) <= 4  # 0.3 s of 0.15 s answers, not 50 of them
    assert time.monotonic() - t0 < 0.3 + SLACK_S


def test_holding_is_capped_at_half_the_lease_timeout():
    src = ScriptedSource([1] + [None] * 50, lease_timeout_s=0.4, sleep_s=0.05)
    t0 = time.monotonic()
    got = collect_leases(src, batch_size=8, min_batch=4, wait_s=30)
    assert [len(x.samples) for x in got] == [1]
    # After the first lease the wait left is half its 0.4 s timeout, not the 30 s asked for.
    assert src.calls[0][2] == 30.0 and src.calls[1][2] <= 0.2 and len(src.calls) <= 0.2 / 0.05 + 2
    assert time.monotonic() - t0 < 0.2 + SLACK_S  # not 30 s: the held lease would expire


def test_a_dry_source_ends_with_what_is_held_then_raises():
    src = ScriptedSource([3])
    assert [len(x.samples) for x in collect_leases(src, batch_size=8, min_batch=8, wait_s=1)] == [3]
    with pytest.raises(SourceExhausted):
        collect_leases(src, batch_size=8, min_batch=8, wait_s=1)


class QuietThenFile:
    """A file source whose first leases come back empty (live traffic with nobody talking yet)."""

    def __init__(self, path, state_path, empty: int):
        from trainer.lease_client import FileSampleSource

        self.inner, self.empty, self.calls = FileSampleSource(path, state_path), empty, 0
        self.weight_updates = self.inner.weight_updates

    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease:
        self.calls += 1
        if self.calls <= self.empty:
            return Lease("", [])
        return self.inner.lease(max_samples, wait_s, min_samples)

    def ack(self, lease_id: str) -> None:
        self.inner.ack(lease_id)

    def update_weights(self, model_path: str, weight_version: str, lineage: object = None) -> WeightsPushed:
        return self.inner.update_weights(model_path, weight_version)


@pytest.mark.slow
def test_empty_waits_never_checkpoint_or_push_weights(tiny_model_dir, sample_file, tmp_path):
    from trainer.settings import TrainConfig
    from trainer.train import train

    out = tmp_path / "out"
    src = QuietThenFile(sample_file, tmp_path / "state.json", empty=3)
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir=str(out),
        steps=1,
        batch_size=4,
        min_batch=4,
        micro_batch_size=4,
        lease_wait_s=0.0,
        lr=1e-3,
        progress=False,
    )
    assert train(cfg, source=src)["step"] == 1
    assert src.calls == 4  # three empty waits, then the step's lease
    assert [v for _, v in src.weight_updates] == ["1"]  # one push, for the one trained step
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000001"]


@pytest.mark.slow
def test_a_lease_without_any_learning_term_is_no_step(tiny_model_dir, sample_file, tmp_path):
    """Baseline none: a lease of reward-0 samples (at-least-one promotions) carries no RL term: no step, no
    checkpoint, no push; its lease is acked with the next step's checkpoint."""
    import json

    from trainer.settings import TrainConfig
    from trainer.train import train

    rows = [json.loads(x) for x in sample_file.read_text().splitlines()][:8]
    for s in rows[:4]:
        s["reward"] = 0.0
    path = tmp_path / "zeros.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in rows))
    src = QuietThenFile(path, tmp_path / "state.json", empty=0)
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir=str(tmp_path / "out"),
        steps=1,
        batch_size=4,
        micro_batch_size=4,
        lr=1e-3,
        baseline="none",
        progress=False,
    )
    assert train(cfg, source=src)["step"] == 1
    assert [v for _, v in src.weight_updates] == ["1"] and src.inner.acked == 8  # both leases acked
    (m,) = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert m["n_samples"] == 4 and m["n_learning_samples"] == sum(s["reward"] != 0 for s in rows[4:])
