"""Constrained samples (CONTRACTS "Sample JSON" ``constrained``): forced tool calls decoded under a regex mask.

Contract under test: their ``rollout_logprobs`` (of the masked distribution, several nats above the model's
own) are never used as old log-probs, not even with ``--old-logprobs rollout``, so neither the PPO ratio
nor the OPD term teacher - old sees them; they are left out of ``train_rollout_lp_abs_diff`` and counted in
``n_constrained`` (their own gap in ``constrained_rollout_lp_abs_diff``). The in-process checks train the
tiny model on one batch whose rollout log-probs are exact, then on the same batch with one sample's rollout
log-probs shifted by +5 nats: flagged constrained, nothing but the constrained metrics may change; not
flagged (the control), the advantages and the gap must change. That invariance holds with
``--rollout-correction none``; with the default ``tis`` a constrained sample DOES take the rollout importance
weight exp(recomputed - rollout) (the right correction for its grammar-masked behaviour distribution,
trainer/rollout_correction.py), which the last test pins at e^-5 for the shifted sample.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from engine.records import Sample
from tests.trainer.conftest import records, rl_record, rl_sample
from trainer.advantages import RunningMean, opd_advantages
from trainer.batch import check_sample, collate
from trainer.lease_client import typed_samples
from trainer.objective import select_old_logprobs
from trainer.settings import TrainConfig

PROMPTS = [f"please {w} the file" for w in "read write open close list search".split()]
SHIFT = 5.0


@pytest.mark.unit
def test_select_old_logprobs_keeps_recomputed_rows_for_constrained_samples():
    recomputed = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    rollout = torch.tensor([[-0.5, -0.5], [-0.1, -0.2]])
    constrained = torch.tensor([False, True])
    assert torch.equal(select_old_logprobs(recomputed, rollout, constrained, "recompute"), recomputed)
    assert torch.equal(
        select_old_logprobs(recomputed, rollout, constrained, "rollout"), torch.tensor([[-0.5, -0.5], [-3.0, -4.0]])
    )
    with pytest.raises(ValueError, match="recompute or rollout"):
        select_old_logprobs(recomputed, rollout, constrained, "teacher")
    # OPD against the selected old: teacher - rollout on the free row, teacher - recomputed on the constrained one.
    teacher = torch.tensor([[-0.7, -0.6], [-2.5, -3.0]])
    old = select_old_logprobs(recomputed, rollout, constrained, "rollout")
    adv = opd_advantages(teacher, old, torch.ones(2, 2), torch.tensor([True, True]))
    torch.testing.assert_close(adv, torch.tensor([[-0.2, -0.1], [0.5, 1.0]]))


@pytest.mark.unit
def test_collate_reads_the_flag_and_the_schema_requires_a_bool():
    b = collate([rl_record("a"), rl_record("b", constrained=True), rl_record("c", constrained=False)])
    assert b.constrained.tolist() == [False, True, False]  # missing means unconstrained (older rows)
    assert check_sample(rl_record("e", constrained=True)) is None
    # A flag that is not a bool never reaches the loop: the lease's JSON edge sets the sample aside.
    typed, aside = typed_samples([rl_sample("f", constrained="yes"), rl_sample("g", constrained=None)])
    assert typed == [] and [a.sample_id for a in aside] == ["f", "g"]
    assert all(a.reason.startswith("off the Sample schema: constrained") for a in aside)


# ----------------------------------------------------------------------------- through train_on_batch
@pytest.fixture(scope="module")
def combine_samples(tiny_model_dir: Path) -> list[Sample]:
    """6 combine samples from the tiny model with exact rollout log-probs and synthetic teacher log-probs."""
    from tests.testkit.local_source import LocalSampleSource

    src = LocalSampleSource(
        tiny_model_dir,
        PROMPTS,
        reward_fn=lambda ids: 1.0 if ids[0] % 2 else -1.0,
        max_new_tokens=6,
        seed=3,
        mode="combine",
    )
    raw = src.lease(6).samples
    for i, s in enumerate(raw):
        s.update(
            sample_id=f"c{i}",
            mode="combine",
            has_teacher=True,
            w_rl=1.0,
            w_opd=1.0,
            teacher_logprobs=[lp + 0.3 - 0.2 * (t % 3) for t, lp in enumerate(s["rollout_logprobs"])],
        )
    samples = records(raw)
    assert len({s.reward for s in samples}) == 2, "both rewards present, so the RL term is not zero"
    exact_rollout_logprobs(samples, tiny_model_dir)
    return samples


def exact_rollout_logprobs(samples: list[Sample], tiny_model_dir: Path) -> None:
    """Replace each sample's rollout log-probs with the trainer's own recomputation (same function, same
    micro-batches), bit for bit.

    The sampler's log-probs agree with the trainer's forward pass only to float32 rounding (another kernel,
    another summation order), and Adam turns that rounding into weight differences of up to lr on the
    coordinates whose gradient is near zero, so "rollout" and "recompute" old log-probs can never be compared
    to a fixed tolerance on every machine. With exact rollout log-probs both sources are the same numbers and
    the flagged sample's +5 nats is the only difference left: the trained weights must then be identical.
    """
    from transformers import AutoModelForCausalLM

    from trainer.old_pass import compute_old_logprobs
    from trainer.update import plan_minibatches

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    cfg = TrainConfig(model_path=str(tiny_model_dir), out_dir="unused", micro_batch_size=4, progress=False)
    plan = plan_minibatches(samples, [False] * len(samples), cfg, 0, 1, torch.device("cpu"), None)
    olds = compute_old_logprobs(model, plan, cfg, 1).olds
    for minibatch, micro_olds in zip(plan, olds, strict=True):
        for micro, old in zip(minibatch.micros, micro_olds, strict=True):
            for row, i in enumerate(micro.sample_index):
                if i >= 0:
                    n = len(samples[i].rollout_logprobs or [])
                    samples[i].rollout_logprobs = old.pg[row, :n].tolist()


@pytest.fixture(scope="module")
def fresh_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).train()


def train_once(
    model0, samples: list[Sample], tiny_model_dir: Path, old_logprobs: str, rollout_correction: str = "none"
) -> tuple[dict, dict]:
    from trainer.train import train_on_batch

    model = copy.deepcopy(model0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir="unused",
        micro_batch_size=4,
        progress=False,
        old_logprobs=old_logprobs,
        rollout_correction=rollout_correction,
    )
    m = train_on_batch(
        model, model, None, opt, samples, [False] * len(samples), cfg, RunningMean(), 0, 1, torch.device("cpu"), None
    )
    return m, {k: v.detach().clone() for k, v in model.state_dict().items()}


def shifted(samples: list[Sample], *, constrained: bool) -> list[Sample]:
    out = copy.deepcopy(samples)
    # log p(token | allowed) >= log p(token)
    out[0].rollout_logprobs = [lp + SHIFT for lp in out[0].rollout_logprobs or []]
    out[0].constrained = constrained
    return out


SAME = ("loss", "pg_loss", "clip_frac", "approx_kl", "adv_mean", "adv_abs_mean", "grad_norm", "n_tokens")


@pytest.mark.slow
@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_constrained_rollout_logprobs_never_reach_the_update(
    tiny_model_dir, combine_samples, fresh_model, old_logprobs
):
    base_m, base_w = train_once(fresh_model, combine_samples, tiny_model_dir, old_logprobs)
    con_m, con_w = train_once(fresh_model, shifted(combine_samples, constrained=True), tiny_model_dir, old_logprobs)
    assert base_m["n_constrained"] == 0 and math.isnan(base_m["constrained_rollout_lp_abs_diff"])
    assert base_m["train_rollout_lp_abs_diff"] < 1e-3  # rollout log-probs came from these weights
    assert con_m["n_constrained"] == 1
    assert con_m["constrained_rollout_lp_abs_diff"] == pytest.approx(SHIFT, abs=1e-3)
    assert con_m["train_rollout_lp_abs_diff"] < 1e-3  # the +5 nats stay out of the drift metric
    # The same numbers go through the same kernels in the same order (exact_rollout_logprobs): equal, not close.
    for k in SAME:
        assert con_m[k] == base_m[k], k
    for k in base_w:
        assert torch.equal(con_w[k], base_w[k]), k


@pytest.mark.slow
def test_control_unflagged_shift_does_reach_the_update_with_rollout_old_logprobs(
    tiny_model_dir, combine_samples, fresh_model
):
    """Without the flag the same shift moves teacher - old by -5 nats on sample 0 and shows in the gap: the
    test above would notice if the flag were ignored."""
    base_m, _ = train_once(fresh_model, combine_samples, tiny_model_dir, "rollout")
    bad_m, _ = train_once(fresh_model, shifted(combine_samples, constrained=False), tiny_model_dir, "rollout")
    n0 = sum(combine_samples[0].loss_mask)
    assert bad_m["n_constrained"] == 0
    assert bad_m["train_rollout_lp_abs_diff"] > 0.5
    # token-mean advantage drops by SHIFT * (sample 0's tokens) / (all tokens)
    assert bad_m["adv_mean"] == pytest.approx(base_m["adv_mean"] - SHIFT * n0 / base_m["n_tokens"], abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_tis_weights_a_constrained_sample_by_its_masked_behaviour_probability(
    tiny_model_dir, combine_samples, fresh_model, old_logprobs
):
    """Constrained rows always use recomputed old log-probs, so even with --old-logprobs rollout their weight is
    exp(recomputed - (recomputed + 5)) = e^-5 on every token of sample 0, and ~1 on the others."""
    base_m, base_w = train_once(fresh_model, combine_samples, tiny_model_dir, old_logprobs, "tis")
    con_m, con_w = train_once(
        fresh_model, shifted(combine_samples, constrained=True), tiny_model_dir, old_logprobs, "tis"
    )
    n0, n = sum(combine_samples[0].loss_mask), base_m["n_tokens"]
    assert base_m["rollout_is_mean"] == pytest.approx(1.0, abs=1e-4) and base_m["rollout_is_truncated_frac"] == 0.0
    expected = (n0 * math.exp(-SHIFT) + (n - n0) * 1.0) / n
    assert con_m["rollout_is_mean"] == pytest.approx(expected, abs=1e-4)
    assert con_m["rollout_is_applied_mean"] == pytest.approx(expected, abs=1e-4)
    assert con_m["rollout_is_truncated_frac"] == 0.0  # w < 1 is never truncated
    assert con_m["loss"] != pytest.approx(base_m["loss"], rel=1e-3)  # sample 0's PPO term shrank by e^-5
    assert any(not torch.allclose(con_w[k], base_w[k], atol=1e-7) for k in base_w)
