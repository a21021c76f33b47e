"""Off-policy correction through ``train_on_batch`` on the tiny model (in-process, one optimizer step).

Contract under test (trainer/rollout_correction.py, CONTRACTS "Trainer"):
- rollout == recomputed (weights exactly 1): none, tis and mis give bit-identical updates;
- one sample's rollout log-probs shifted down by 5 nats (w = e^5 on its tokens; a stale or hotter behaviour):
  none ignores it; tis bounds it to exactly C = 2 (the same update as doubling that sample's advantage);
  mis rejects its tokens (the same update as excluding the sample); an uncapped weight blows the gradient up;
- a client at temperature 0.5: with ``--logprob-temperature sample`` the recomputation matches the rollout
  (weights ~1), with ``one`` the weights are exp(lp_T=1 - lp_T=0.5), checked against an independent forward.
RL mode with ``--baseline none`` so A = r per sample and samples do not couple through the baseline.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from engine.records import Sample
from tests.trainer.conftest import records
from trainer.advantages import RunningMean
from trainer.batch import collate, score_responses
from trainer.settings import TrainConfig

pytestmark = pytest.mark.slow
PROMPTS = [f"please {w} the file" for w in "read write open close list search".split()]
SHIFT = 5.0
MICRO = 4


@pytest.fixture(scope="module")
def model0(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).train()


def _samples(tiny_model_dir: Path, n: int, *, temperature: float = 1.0, seed: int = 5) -> list[Sample]:
    from tests.testkit.local_source import LocalSampleSource

    src = LocalSampleSource(
        tiny_model_dir,
        PROMPTS,
        reward_fn=lambda ids: 1.0 if ids[0] % 2 else -1.0,
        max_new_tokens=6,
        seed=seed,
        temperature=temperature,
    )
    out = records(src.lease(n).samples)
    for i, s in enumerate(out):
        s.sample_id = f"t{i}"
    return out


@pytest.fixture(scope="module")
def exact_samples(tiny_model_dir: Path, model0) -> list[Sample]:
    """8 samples whose rollout log-probs ARE the trainer's recomputation (same micro-batches, same forward)."""
    samples = _samples(tiny_model_dir, 8)
    with torch.no_grad():
        for j in range(0, len(samples), MICRO):
            chunk = samples[j : j + MICRO]
            lp = score_responses(model0, collate(chunk), with_entropy=False).logprobs
            for i, s in enumerate(chunk):
                s.rollout_logprobs = lp[i, : len(s.response_ids)].tolist()
    assert {s.reward for s in samples} == {1.0, -1.0}
    return samples


def train_once(model0, samples: list[Sample], tiny_model_dir: Path, **kw) -> tuple[dict, dict]:
    from trainer.train import train_on_batch

    model = copy.deepcopy(model0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir="unused",
        micro_batch_size=MICRO,
        progress=False,
        baseline="none",
        advantage_mode="rl",
        max_grad_norm=0.0,
        **kw,
    )
    m = train_on_batch(
        model, model, None, opt, samples, [False] * len(samples), cfg, RunningMean(), 0, 1, torch.device("cpu"), None
    )
    return m, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: tuple[dict, dict], b: tuple[dict, dict], keys=("loss", "pg_loss", "grad_norm", "n_tokens")) -> None:
    """Bit-identical: both runs put the same samples through the same micro-batches, and what differs is exact
    (a weight never read, a factor of 2 on a term, a token weighted 0 vs masked), so no float tolerance is
    needed, and none could be fixed: Adam would turn any rounding on a near-zero gradient into up to lr."""
    for k in keys:
        assert a[0][k] == b[0][k], k
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


def test_weights_of_one_change_nothing(tiny_model_dir, model0, exact_samples):
    runs = {
        mode: train_once(model0, exact_samples, tiny_model_dir, rollout_correction=mode)
        for mode in ("none", "tis", "mis")
    }
    for mode, (m, _) in runs.items():
        assert m["train_rollout_lp_abs_diff"] == 0.0
        assert m["rollout_is_mean"] == 1.0 and m["rollout_is_max"] == 1.0 and m["rollout_is_applied_mean"] == 1.0, mode
        assert m["rollout_is_over_cap_frac"] == 0.0
        assert m["n_with_sampling_params"] == 8 and m["sample_temperature_mean"] == 1.0
    for mode in ("tis", "mis"):
        assert runs[mode][0]["loss"] == runs["none"][0]["loss"]
        for k, v in runs["none"][1].items():
            assert torch.equal(runs[mode][1][k], v), (mode, k)


def _shifted(samples: list[Sample]) -> list[Sample]:
    out = copy.deepcopy(samples)
    out[0].rollout_logprobs = [lp - SHIFT for lp in out[0].rollout_logprobs]  # w = e^5 on sample 0's tokens
    return out


def test_a_shifted_sample_is_bounded_by_the_cap(tiny_model_dir, model0, exact_samples):
    shifted = _shifted(exact_samples)
    n0 = len(exact_samples[0].response_ids)
    base = train_once(model0, exact_samples, tiny_model_dir, rollout_correction="none")
    n = base[0]["n_tokens"]

    # none: the weight never enters the update.
    none = train_once(model0, shifted, tiny_model_dir, rollout_correction="none")
    assert none[0]["rollout_is_max"] == pytest.approx(math.exp(SHIFT), rel=1e-4)
    assert none[0]["rollout_is_truncated_frac"] == 0.0
    assert_same(none, base)

    # tis: sample 0 counts exactly C = 2 times: the update of doubling its advantage (A = r with baseline none).
    tis = train_once(model0, shifted, tiny_model_dir, rollout_correction="tis")
    doubled = copy.deepcopy(exact_samples)
    doubled[0].reward *= 2.0
    assert_same(tis, train_once(model0, doubled, tiny_model_dir, rollout_correction="none"))
    assert tis[0]["rollout_is_truncated_frac"] == pytest.approx(n0 / n)
    assert tis[0]["rollout_is_applied_mean"] == pytest.approx((2.0 * n0 + (n - n0)) / n, rel=1e-6)
    assert tis[0]["rollout_is_mean"] == pytest.approx((math.exp(SHIFT) * n0 + (n - n0)) / n, rel=1e-4)

    # mis: sample 0's tokens are rejected from numerator and denominator: the update without sample 0.
    mis = train_once(model0, shifted, tiny_model_dir, rollout_correction="mis")
    dropped = copy.deepcopy(exact_samples)
    dropped[0].loss_mask = [0] * n0
    assert_same(mis, train_once(model0, dropped, tiny_model_dir, rollout_correction="none"))
    assert mis[0]["rollout_is_masked_frac"] == pytest.approx(n0 / n) and mis[0]["n_tokens"] == n - n0

    # The cap is what bounds it: an (effectively) uncapped weight multiplies sample 0 by e^5 ~ 148.
    uncapped = train_once(model0, shifted, tiny_model_dir, rollout_correction="tis", rollout_is_cap=1e6)
    assert uncapped[0]["rollout_is_truncated_frac"] == 0.0
    assert uncapped[0]["grad_norm"] > 5 * tis[0]["grad_norm"]


def test_temperature_mismatch_is_absorbed_by_the_weight_or_removed_by_sample_temperature(tiny_model_dir, model0):
    samples = _samples(tiny_model_dir, 6, temperature=0.5, seed=11)
    assert all(s.sampling_params["temperature"] == 0.5 for s in samples)
    sample_m, _ = train_once(model0, samples, tiny_model_dir, rollout_correction="tis", logprob_temperature="sample")
    one_m, _ = train_once(model0, samples, tiny_model_dir, rollout_correction="tis", logprob_temperature="one")
    assert sample_m["sample_temperature_mean"] == 0.5
    # Like with like: the recomputation at T = 0.5 matches the rollout; weights ~1, nothing truncated.
    assert sample_m["train_rollout_lp_abs_diff"] < 1e-4
    assert sample_m["rollout_is_mean"] == pytest.approx(1.0, abs=1e-4) and sample_m["rollout_is_truncated_frac"] == 0.0

    # T = 1 training: w = exp(lp_1 - lp_0.5) from an independent forward of each sample alone.
    ws = []
    with torch.no_grad():
        for s in samples:
            p, r = len(s.prompt_ids), len(s.response_ids)
            logits = (
                model0(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, p - 1 : p - 1 + r].float()
            )
            tok = torch.tensor(s.response_ids)[:, None]
            lp1 = torch.log_softmax(logits, -1).gather(-1, tok)[:, 0]
            lp_half = torch.log_softmax(logits / 0.5, -1).gather(-1, tok)[:, 0]
            torch.testing.assert_close(lp_half, torch.tensor(s.rollout_logprobs), atol=1e-4, rtol=0)
            ws.append(torch.exp(lp1 - lp_half))
    w = torch.cat(ws)
    assert one_m["train_rollout_lp_abs_diff"] > 0.01
    assert one_m["rollout_is_mean"] == pytest.approx(float(w.mean()), rel=1e-3)
    assert one_m["rollout_is_max"] == pytest.approx(float(w.max()), rel=1e-3)
    assert one_m["rollout_is_truncated_frac"] == pytest.approx(float((w > 2.0).float().mean()), abs=1e-9)
    assert one_m["rollout_is_applied_mean"] == pytest.approx(float(w.clamp(max=2.0).mean()), rel=1e-3)
