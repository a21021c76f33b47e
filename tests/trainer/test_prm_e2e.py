"""Process rewards end to end: LengthBudgetScorer + the LLM-judge scorer, configured in
one PRM YAML, through the policy server into the trainer.

Stack (tests/testkit/stack.py): dev engine <- policy server (mode rl, ``--prm-config prm.yaml``) -> judge server
(rules backend). The YAML has ``LengthBudgetScorer(max_output_tokens=2)`` and ``LLMJudgeScorer`` (calling the
same judge service, ``reward_range: unit``), weights 0.5 / 0.5, shaping ``process_weighted``. The scripted user's
feedback makes the judge's verdict deterministic, and replies of 1-2 or 4 tokens make the length scorer vary, so
each turn's token reward is 0.5 * [len <= 2] + 0.5 * [judge +1], one of 0, 0.5, 1.

The trainer gets the SAME file (``prm_config``) and leases over HTTP. Checked: every leased sample carries
``token_rewards`` of exactly that value on each response token; the trainer's logged advantage equals the
process_weighted shaping of the outcome advantage recomputed from the leased samples with the trainer's own
functions, and differs from the unshaped one; the lease's PRM metrics window is in metrics.jsonl; the step
checkpoint is loaded by the engine.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from engine.records import Sample
from tests.testkit.servers import ADMIN_KEY as ADMIN
from tests.testkit.stack import ScriptedUser, start_stack
from tests.waiting import wait_until
from trainer.advantages import rl_sample_advantages
from trainer.batch import collate
from trainer.lease_client import Lease, PolicyClient
from trainer.objective import outcome_advantages, shape
from trainer.prm import resolve_prm_config
from trainer.settings import TrainConfig
from trainer.train import train

pytestmark = pytest.mark.e2e

BUDGET = 2
PRM_YAML = f"""
prm:
  enabled: true
  advantage_shaping: {{mode: process_weighted}}
  scorers:
    - path: prm.scorers.LengthBudgetScorer
      weight: 0.5
      kwargs: {{max_output_tokens: {BUDGET}}}
    - path: prm.scorers.LLMJudgeScorer
      weight: 0.5
      kwargs: {{judge_url: "{{judge_url}}", m: 1, reward_range: unit, timeout_s: 10, deadline_s: 20}}
actor:
  token_rewards_as_adv: true
  mask_no_eos_with_zero: false
"""


class RecordingPolicyClient(PolicyClient):
    """The trainer's real HTTP client, keeping what each lease returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.leases: list[Lease] = []

    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease:
        got = super().lease(max_samples, wait_s, min_samples)
        if got.samples:
            self.leases.append(got)
        return got


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    st = start_stack(tiny_model_dir, tmp_path_factory.mktemp("prm-e2e"), prm_yaml=PRM_YAML)
    try:
        yield st
    finally:
        st.stop()


def test_length_budget_and_judge_scorers_shape_the_trainers_advantages(stack, tmp_path):
    prm = stack.stats()["prm"]
    assert prm["enabled"] and prm["advantage_shaping"] == "process_weighted"
    assert sorted(s["name"] for s in prm["scorers"]) == ["length_budget", "llm_judge"]

    is_good = lambda text: any(c.isupper() for c in text)  # noqa: E731 (the user's (deterministic) criterion)
    sent = 0
    for max_tokens, prefix in ((2, "short"), (4, "long")):
        user = ScriptedUser(stack.policy.url, is_good, max_tokens=max_tokens)
        try:
            user.run(
                prefix, [f"please {w} the file" for w in ("read", "open", "list", "fix")], turns=2, seed=max_tokens
            )
        finally:
            user.close()
        sent += 4 * 3

    def judged() -> dict | None:
        counts = stack.stats()["samples"]
        return None if counts["pending_judge"] or sum(counts.values()) < sent else counts

    counts = wait_until(judged, timeout_s=60, interval_s=0.1, message=lambda: stack.stats()["samples"])
    assert counts["ready"] >= 12, stack.stats()["reject_reasons"]

    out = tmp_path / "train"
    cfg = TrainConfig(
        model_path=str(stack.model_dir),
        out_dir=str(out),
        policy_url=stack.policy.url,
        admin_api_key=ADMIN,
        prm_config=str(stack.prm_config),
        steps=1,
        batch_size=32,
        micro_batch_size=32,
        lr=1e-3,
        lease_wait_s=5.0,
        progress=False,
        weight_sync_timeout_s=60.0,
    )
    src = RecordingPolicyClient(stack.policy.url, ADMIN)
    try:
        assert train(cfg, source=src)["step"] == 1
    finally:
        src.close()

    (lease,) = src.leases
    samples = lease.samples
    assert len(samples) == counts["ready"]
    lengths = set()
    for s in samples:
        tr, n = s["token_rewards"], len(s["response_ids"])
        assert tr is not None and len(tr) == n, s
        expected = 0.5 * (n <= BUDGET) + 0.5 * (s["reward"] > 0)
        assert tr == pytest.approx([expected] * n), (s["response_ids"], s["reward"], tr)
        lengths.add(n <= BUDGET)
    assert lengths == {True, False}, "both length outcomes must occur for the test to mean something"

    # The advantage the trainer logged is the process_weighted shaping of the outcome advantage of these samples.
    resolved = resolve_prm_config(cfg)
    assert resolved.shaping == "process_weighted"
    b = collate([Sample.model_validate(s) for s in samples])  # read as the trainer reads a lease
    rl = rl_sample_advantages(
        b.reward, b.has_reward, baseline=resolved.baseline, normalize=resolved.normalize_advantages
    )
    raw = outcome_advantages(b, b.rollout_lp, rl, resolved)
    shaped = shape(b, raw, resolved)
    ntok = float(b.mask.sum())
    (m,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["n_with_token_rewards"] == len(samples) and m["shaped_tokens"] == int(ntok)
    assert m["adv_unshaped_mean"] == pytest.approx(float(raw.sum()) / ntok, abs=1e-5)
    assert m["adv_mean"] == pytest.approx(float(shaped.sum()) / ntok, abs=1e-5)
    assert abs(m["adv_mean"] - m["adv_unshaped_mean"]) > 0.05, m
    assert not torch.allclose(shaped, raw)
    # The PRM metrics window the lease carried is logged with the step.
    assert lease.prm_metrics and m["prm_metrics_windows"] == 1
    for name in ("rollout/prm_turn_reward/length_budget", "rollout/prm_turn_reward/llm_judge"):
        assert m[name] == pytest.approx(lease.prm_metrics[name])
    assert m["rollout/prm_metric/turn/length_budget/within_budget/rate"] == pytest.approx(
        sum(len(s["response_ids"]) <= BUDGET for s in samples) / len(samples)
    )

    # One step completed and its weights are what the engine serves.
    stats = stack.stats()
    assert stats["samples"]["consumed"] == len(samples) and str(stats["weight_version"]) == "1"
    served = httpx.get(stack.engine.url + "/get_weight_version", timeout=10, trust_env=False).json()
    assert str(served["weight_version"]) == "1", served
