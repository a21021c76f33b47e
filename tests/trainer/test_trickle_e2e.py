"""The trickle closed loop (the proof of the live-traffic hand-off): samples arrive one at a time while the
trainer runs concurrently, and the policy still learns what the judge rewards.

Stack (tests/trainer/stack.py): dev engine on a private copy of the tiny model <- policy server (mode rl) ->
judge server (rules backend, m=1). A scripted user works through sessions ONE AT A TIME, one turn at a time
with a pause after each, answering "Thanks, that worked." when the reply contains the target (an uppercase
letter, as in test_learning_e2e) and "No, that is wrong." otherwise, so each judged turn becomes ready on its
own. Meanwhile ``hindsight-train --min-batch 4`` (a subprocess, default running-mean baseline) leases with
``min=4``, trains, checkpoints and pushes weights to the engine, and stops after its idle timeout once the
user is done.

Asserted: the target frequency on held-out prompts (straight from the engine, fixed seeds) ends clearly above
its start; no service answered any HTTP 5xx (their /metrics request counters by status, and their logs); every
judged sample was consumed; the trainer exited 0. Reported: the share of steps with a non-zero RL advantage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from engine.chat import load_tokenizer
from tests.trainer.stack import ADMIN, ScriptedUser, start_stack
from tests.trainer.test_learning_e2e import PROMPTS, has_target, target_frequency

pytestmark = pytest.mark.e2e

MAX_TOKENS = 3
SESSIONS, TURNS = 32, 4
PAUSE_S = 0.05  # the user's think time between turns (traffic shape, not synchronisation)
MIN_BATCH, BATCH = 4, 8
MARGIN = 0.2


def count_5xx(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.endswith("_http_requests_total") and s.labels.get("status", "").startswith("5")
    )


class PacedUser(ScriptedUser):
    """Sessions one after another, each turn followed by a pause."""

    def _chat(self, messages, sid, seed, max_tokens, done=False):
        out = super()._chat(messages, sid, seed, max_tokens, done)
        time.sleep(PAUSE_S)
        return out


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    st = start_stack(tiny_model_dir, tmp_path_factory.mktemp("trickle-e2e"), engine_seed=1)
    try:
        yield st
    finally:
        st.stop()


@pytest.mark.timeout(900)
def test_trickle_closed_loop_learns_with_min_batch(stack, tmp_path):
    tokenizer = load_tokenizer(str(stack.model_dir))
    start = target_frequency(stack.engine.url, tokenizer)
    assert 0.1 < start < 0.6, start
    out = tmp_path / "train"
    log = tmp_path / "trainer.log"
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "--policy-url",
        stack.policy.url,
        "--model-path",
        str(stack.model_dir),
        "--out-dir",
        str(out),
        "--steps",
        "1000",
        "--batch-size",
        str(BATCH),
        "--min-batch",
        str(MIN_BATCH),
        "--micro-batch-size",
        str(BATCH),
        "--lr",
        "2e-2",
        "--lease-wait-s",
        "10",
        "--idle-timeout-s",
        "12",
        "--keep-checkpoints",
        "1",
        "--no-progress",
        "--no-sync-on-resume",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HINDSIGHT_TRAIN_ADMIN_API_KEY": ADMIN}
    with open(log, "wb") as fh:
        trainer = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    user = PacedUser(stack.policy.url, has_target, max_tokens=MAX_TOKENS, workers=1)
    outcomes: list[bool] = []
    try:
        for i in range(SESSIONS):
            outcomes += user.session(f"trickle-{i}", PROMPTS[i % len(PROMPTS)], TURNS, seed=500 + i)
        rc = trainer.wait(timeout=300)
    finally:
        user.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    tail = log.read_text(errors="replace")[-4000:]
    assert rc == 0, tail
    end = target_frequency(stack.engine.url, tokenizer)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    nonzero = sum(m["rl_adv_nonzero"] > 0 for m in metrics) / len(metrics)
    sizes = [m["n_samples"] for m in metrics]
    print(
        f"target frequency {start:.3f} -> {end:.3f}; {len(metrics)} steps, samples per step {sizes}; "
        f"share of steps with a non-zero RL advantage {nonzero:.2f}; rewarded share of user turns "
        f"{sum(outcomes) / len(outcomes):.2f}"
    )
    assert end >= start + MARGIN, (start, end, sizes)
    assert all(n >= 1 for n in sizes) and sum(n >= MIN_BATCH for n in sizes) >= len(sizes) - 2, sizes
    stats = stack.stats()
    assert stats["samples"]["ready"] == 0 and stats["samples"]["leased"] == 0
    assert stats["samples"]["consumed"] >= sum(sizes)  # leases holding only untrainable samples are acked too
    assert str(stats["weight_version"]) == str(metrics[-1]["step"])
    for proc in (stack.engine, stack.judge, stack.policy):
        assert count_5xx(proc.url) == 0, proc.name
        text = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in text and " -> 5" not in text, proc.log_tail()
    assert "HTTP 5" not in log.read_text(errors="replace")  # the trainer's client never saw a 5xx either
