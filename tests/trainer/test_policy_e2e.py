"""The trainer against the real stack: dev engine <- policy server (rl mode) -> judge server (rules backend).

A scripted user drives sessions through ``/v1/chat/completions``; its next message says "Thanks, that
worked." when the reply contains a target token and "No, that is wrong." otherwise, so the rules judge
scores each paired turn +1 / -1. The trainer (in-process) leases those samples over HTTP, trains, saves,
acks, and asks the policy server to load the checkpoint into the engine. Checked: the samples leased are
the ones the users produced (ids match the engine's), every lease is acked after its checkpoint, and the
engine reports the new weight version.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.testkit.servers import ADMIN_KEY as ADMIN
from tests.testkit.servers import CLIENT_KEY as CLIENT
from tests.testkit.stack import start_stack
from trainer.settings import TrainConfig
from trainer.train import train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    policy_args = ["--model-aliases", "policy", "--session-idle-timeout-s", "2"]
    st = start_stack(tiny_model_dir, tmp_path_factory.mktemp("stack"), copy_model=False, policy_args=policy_args)
    try:
        yield {"engine": st.engine, "judge": st.judge, "policy": st.policy}
    finally:
        st.stop()


def drive_sessions(url: str, n_sessions: int, turns: int, target_text: set[str]) -> int:
    """Scripted users; returns the number of turns that got a next state (and so a verdict)."""
    paired = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {CLIENT}"}, timeout=60, trust_env=False) as c:
        for s in range(n_sessions):
            messages = [{"role": "user", "content": f"please read the file number {s}"}]
            for t in range(turns):
                r = c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "policy",
                        "messages": messages,
                        "max_tokens": 8,
                        "temperature": 1.0,
                        "user": f"session-{s}",
                    },
                    headers={"X-Session-Id": f"sess-{s}"},
                )
                assert r.status_code == 200, r.text
                reply = r.json()["choices"][0]["message"].get("content") or ""
                good = any(w in reply for w in target_text)
                feedback = "Thanks, that worked." if good else "No, that is wrong."
                messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]
                if t > 0:
                    paired += 1
            # the final feedback message pairs the last turn
            r = c.post(
                "/v1/chat/completions",
                json={"model": "policy", "messages": messages, "max_tokens": 2},
                headers={"X-Session-Id": f"sess-{s}"},
            )
            assert r.status_code == 200, r.text
            paired += 1
    return paired


def test_trainer_leases_trains_acks_and_syncs_weights(stack, tiny_model_dir, tmp_path):
    policy, engine = stack["policy"], stack["engine"]
    paired = drive_sessions(policy.url, n_sessions=4, turns=2, target_text={"e"})
    assert paired >= 8
    out = tmp_path / "train"
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir=str(out),
        policy_url=policy.url,
        admin_api_key=ADMIN,
        steps=2,
        batch_size=4,
        lr=1e-3,
        micro_batch_size=4,
        lease_wait_s=20.0,
        idle_timeout_s=40.0,
        progress=False,
        # r = +-1 is never 0: every batch has a gradient (a batch whose rewards equal a running mean is no step)
        baseline="none",
    )
    result = train(cfg)
    assert result["step"] == 2, result
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["n_with_reward"] >= 1 for m in metrics)
    # rollout log-probs come from the engine that serves the initial weights: the recomputation agrees
    assert metrics[0]["train_rollout_lp_abs_diff"] < 1e-2
    with httpx.Client(
        base_url=policy.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, trust_env=False
    ) as a:
        stats = a.get("/v1/samples/stats").json()
    assert stats["samples"]["consumed"] == paired and stats["samples"]["leased"] == 0 and stats["samples"]["ready"] == 0
    assert str(stats["weight_version"]) == "2"
    # the engine itself (not only the policy server's bookkeeping) now serves the step-2 checkpoint
    served = httpx.get(engine.url + "/get_weight_version", timeout=10, trust_env=False).json()
    assert str(served["weight_version"]) == "2", served
