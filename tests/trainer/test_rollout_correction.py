"""Rollout importance weights and sampling temperature (trainer/rollout_correction.py) against hand-derived numbers.

Contract under test: w_t = exp(old_t - rollout_t) on valid tokens only; tis applies min(w, C), mis applies w
below C and 0 above it (and rejects those tokens from the loss mask); none applies 1 but still reports the raw
statistics; padding / excluded tokens are never weighted or counted whatever their log-probs; the weight
multiplies the PPO term only; a sample's temperature comes from ``sampling_params`` (1.0 when absent or greedy)
and ``--logprob-temperature sample`` scores log softmax(logits / T).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.records import Sample
from trainer.batch import check_sample, collate
from trainer.cli import parse_config
from trainer.lease_client import typed_samples
from trainer.objective import micro_loss
from trainer.rollout_correction import is_metrics, rollout_is_weights, sample_temperature, temperature_logprobs
from trainer.settings import TrainConfig

pytestmark = pytest.mark.unit
T = torch.tensor
LN = math.log


def _weights(mode: str, cap: float = 2.0):
    # w = [1, 3, 0.5, 4]; the last token is padding (mask 0) with a huge weight that must never count.
    old = torch.log(T([[1.0, 3.0, 0.5, 4.0]]))
    rollout = torch.zeros(1, 4)
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    return rollout_is_weights(old, rollout, mask, mode, cap)


def test_tis_truncates_at_the_cap_on_valid_tokens_only():
    w = _weights("tis")
    torch.testing.assert_close(w.applied, T([[1.0, 2.0, 0.5, 1.0]]))
    torch.testing.assert_close(w.raw, T([[1.0, 3.0, 0.5, 1.0]]))  # padding reads 1, not 4
    assert w.keep.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert w.stats == pytest.approx(
        {"is_tokens": 3.0, "is_sum": 4.5, "is_applied_sum": 3.5, "is_over_cap": 1.0, "is_max": 3.0}
    )
    m = is_metrics(w.stats, w.stats["is_max"], "tis")
    assert m == pytest.approx(
        {
            "rollout_is_mean": 1.5,
            "rollout_is_max": 3.0,
            "rollout_is_applied_mean": 3.5 / 3,
            "rollout_is_over_cap_frac": 1 / 3,
            "rollout_is_truncated_frac": 1 / 3,
            "rollout_is_masked_frac": 0.0,
        }
    )


def test_mis_zeroes_and_rejects_tokens_above_the_cap():
    w = _weights("mis")
    torch.testing.assert_close(w.applied, T([[1.0, 0.0, 0.5, 1.0]]))  # kept tokens keep their weight w
    assert w.keep.tolist() == [[1.0, 0.0, 1.0, 1.0]]
    assert w.stats["is_applied_sum"] == pytest.approx(1.5) and w.stats["is_over_cap"] == 1.0
    m = is_metrics(w.stats, w.stats["is_max"], "mis")
    assert m["rollout_is_masked_frac"] == pytest.approx(1 / 3) and m["rollout_is_truncated_frac"] == 0.0


def test_none_applies_one_but_reports_the_raw_weights():
    w = _weights("none")
    assert w.applied.tolist() == [[1.0] * 4] and w.keep.tolist() == [[1.0] * 4]
    m = is_metrics(w.stats, w.stats["is_max"], "none")
    assert m["rollout_is_mean"] == pytest.approx(1.5) and m["rollout_is_max"] == pytest.approx(3.0)
    assert (
        m["rollout_is_applied_mean"] == 1.0
        and m["rollout_is_truncated_frac"] == 0.0
        and m["rollout_is_masked_frac"] == 0.0
    )


def test_invalid_tokens_are_never_counted_even_with_garbage_logprobs():
    old = T([[-1.0, 5.0], [-2.0, -2.0]])
    rollout = T([[-1.0, -1e30], [-1e30, 0.0]])  # garbage on padding / an excluded row
    mask = T([[1.0, 0.0], [0.0, 0.0]])
    for mode in ("none", "tis", "mis"):
        w = rollout_is_weights(old, rollout, mask, mode, 2.0)
        assert w.stats == {"is_tokens": 1.0, "is_sum": 1.0, "is_applied_sum": 1.0, "is_over_cap": 0.0, "is_max": 1.0}
        assert torch.isfinite(w.applied).all() and w.keep.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    empty = rollout_is_weights(old, rollout, torch.zeros(2, 2), "tis", 2.0)
    m = is_metrics(empty.stats, empty.stats["is_max"], "tis")
    assert math.isnan(m["rollout_is_mean"]) and m["rollout_is_truncated_frac"] == 0.0
    with pytest.raises(ValueError, match="rollout correction"):
        rollout_is_weights(old, rollout, mask, "clip", 2.0)


def test_temperature_logprobs_scale_the_logits_per_sample():
    # logits [0, ln 4]: p(1) = 4/5 at T=1, 2/3 at T=2 ([0, ln 2]), 16/17 at T=0.5 ([0, ln 16]).
    logits = T([[0.0, LN(4.0)]]).expand(3, 1, 2).contiguous()
    targets = torch.ones(3, 1, dtype=torch.long)
    lp = temperature_logprobs(logits, targets, T([1.0, 2.0, 0.5]))
    torch.testing.assert_close(lp, T([[LN(4 / 5)], [LN(2 / 3)], [LN(16 / 17)]]))
    torch.testing.assert_close(temperature_logprobs(logits, targets, torch.ones(3)), torch.full((3, 1), LN(4 / 5)))


def _json(**kw) -> dict:
    base = {
        "sample_id": "a",
        "mode": "rl",
        "prompt_ids": [5],
        "response_ids": [0, 1, 1],
        "rollout_logprobs": [-1.0] * 3,
        "loss_mask": [1, 1, 1],
        "reward": 1.0,
        "has_reward": True,
        "has_teacher": False,
    }
    return {**base, **kw}


def _sample(**kw) -> Sample:
    """:func:`_json` read as the trainer reads a leased sample."""
    return Sample.model_validate(_json(**kw))


def test_sample_temperature_and_the_contract_checks():
    assert sample_temperature(_sample()) == 1.0  # older samples carry no sampling_params
    assert sample_temperature(_sample(sampling_params=None)) == 1.0
    assert sample_temperature(_sample(sampling_params={"max_new_tokens": 8})) == 1.0
    assert sample_temperature(_sample(sampling_params={"temperature": None})) == 1.0
    assert sample_temperature(_sample(sampling_params={"temperature": 0})) == 1.0  # greedy: SGLang scores at T = 1
    assert sample_temperature(_sample(sampling_params={"temperature": 0.7, "top_p": 0.9})) == 0.7
    assert collate([_sample(), _sample(sampling_params={"temperature": 1.3})]).temperature.tolist() == pytest.approx(
        [1.0, 1.3]
    )
    assert check_sample(_sample(sampling_params={"temperature": 0.7, "top_p": 0.9, "top_k": 20})) is None
    # sampling_params that is not an object never reaches the loop: the lease's JSON edge sets it aside
    [aside] = typed_samples([_json(sampling_params=[0.7])])[1]
    assert aside.reason.startswith("off the Sample schema: sampling_params")
    for bad in ("hot", -0.5, float("nan"), True):
        assert "temperature must be a finite number" in check_sample(_sample(sampling_params={"temperature": bad}))
    assert "rollout_logprobs holds a non-finite" in check_sample(_sample(rollout_logprobs=[-1.0, float("nan"), -1.0]))


def test_cli_defaults_and_cap_validation(tmp_path):
    cfg = parse_config(["--model-path", "m", "--out-dir", str(tmp_path)])
    assert (cfg.rollout_correction, cfg.rollout_is_cap, cfg.logprob_temperature) == ("tis", 2.0, "one")
    cfg = parse_config(
        [
            "--model-path",
            "m",
            "--out-dir",
            str(tmp_path),
            "--rollout-correction",
            "mis",
            "--rollout-is-cap",
            "3",
            "--logprob-temperature",
            "sample",
        ]
    )
    assert (cfg.rollout_correction, cfg.rollout_is_cap, cfg.logprob_temperature) == ("mis", 3.0, "sample")
    for argv in (["--rollout-is-cap", "0.5"], ["--rollout-correction", "clip"], ["--logprob-temperature", "two"]):
        with pytest.raises(SystemExit) as exc:
            parse_config(["--model-path", "m", "--out-dir", str(tmp_path), *argv])
        assert exc.value.code == 2


# ----------------------------------------------------------------------------- the weight inside micro_loss
class TableModel(torch.nn.Module):
    """Logits are a parameter table (B, L, V): the loss gradient w.r.t. each logit can be derived by hand."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids, attention_mask, use_cache):  # the HF call signature (arguments unused)
        return SimpleNamespace(logits=self.table)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(model_path="m", out_dir="o", progress=False, **kw)


@pytest.mark.parametrize(
    "mode,weights", [("none", [1.0, 1.0, 1.0]), ("tis", [1.0, 2.0, 0.5]), ("mis", [1.0, 0.0, 0.5])]
)
def test_micro_loss_multiplies_the_ppo_term_by_the_detached_weight(mode, weights):
    # Uniform logits over V=2 -> every recomputed log-prob is ln 0.5; rollout chosen so that w = [1, 3, 0.5].
    b = collate([_sample()])
    model = TableModel(torch.zeros(1, 4, 2))
    old = torch.full((1, 3), LN(0.5))
    rollout = old - torch.log(T([[1.0, 3.0, 0.5]]))
    applied = rollout_is_weights(old, rollout, b.mask, mode, 2.0).applied.requires_grad_()  # detach must cut it
    adv = torch.ones(1, 3)
    loss, st = micro_loss(model, None, b, old, adv, _cfg(), num_tokens=3.0, num_seqs=1.0, is_weight=applied)
    # ratio 1, A = 1: per-token loss -w_t; token mean over 3 valid tokens.
    assert float(loss.detach()) == pytest.approx(-sum(weights) / 3, abs=1e-6)
    loss.backward()
    # d loss / d lp_t = -w_t / 3; d lp_t / d logit[target] = 1 - 0.5, d lp_t / d logit[other] = -0.5.
    g = model.table.grad[0, :3]  # positions 0..2 predict the response tokens 0, 1, 1
    for t, (tok, wt) in enumerate(zip([0, 1, 1], weights, strict=True)):
        assert float(g[t, tok]) == pytest.approx(-wt / 3 * 0.5, abs=1e-6)
        assert float(g[t, 1 - tok]) == pytest.approx(wt / 3 * 0.5, abs=1e-6)
    assert float(model.table.grad[0, 3].abs().sum()) == 0.0  # the position after the last token is never scored
    assert st["tokens"] == 3.0
    assert applied.grad is None


def test_sample_temperature_scores_the_ppo_term_at_the_samples_temperature():
    # logits [0, ln 4] at every position, targets [1, 1, 1], T = 2: lp = ln(2/3) with sample, ln(4/5) with one.
    s = _sample(response_ids=[1, 1, 1], sampling_params={"temperature": 2.0})
    b = collate([s])
    table = T([0.0, LN(4.0)]).expand(1, 4, 2).contiguous()
    old = torch.full((1, 3), LN(2 / 3))  # the old pass at the sample's temperature
    _, st_sample = micro_loss(
        TableModel(table),
        None,
        b,
        old,
        torch.ones(1, 3),
        _cfg(logprob_temperature="sample"),
        num_tokens=3.0,
        num_seqs=1.0,
    )
    _, st_one = micro_loss(
        TableModel(table), None, b, old, torch.ones(1, 3), _cfg(logprob_temperature="one"), num_tokens=3.0, num_seqs=1.0
    )
    assert st_sample["approx_kl"] == pytest.approx(0.0, abs=1e-10)  # like with like: ratio exactly 1
    assert st_one["approx_kl"] == pytest.approx(3 * 0.5 * (LN(4 / 5) - LN(2 / 3)) ** 2, rel=1e-5)
