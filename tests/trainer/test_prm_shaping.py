"""Trainer side of process rewards: sample -> tensors, shaping routing, config from the PRM YAML.

Contract under test (trainer/prm.py, trainer/objective.py, trainer/batch.py):
- ``token_rewards`` land on the same (B, T) response positions as the log-probs; a sample without them gets
  zeros and ``has_token_rewards`` False, and its advantage is never shaped;
- shaping runs after the outcome advantage (whole-batch baseline / std), only on loss-mask tokens of samples
  that carry token_rewards, with AReaL's exact formulas;
- bad token_rewards (wrong length, non-finite, outside [0, 1] under process_weighted) set the sample aside;
- ``--prm-config`` is read by prm's loader only; flags that contradict it are errors;
- the training loop logs unshaped vs shaped advantage statistics and the lease's PRM metrics window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.records import Sample, WeightsPushed
from prm import PRMConfigError
from trainer.advantages import rl_sample_advantages
from trainer.batch import check_sample, collate
from trainer.cli import parse_config
from trainer.lease_client import Lease, typed_samples
from trainer.objective import outcome_advantages, shape, token_advantages
from trainer.prm import resolve_prm_config
from trainer.settings import TrainConfig


def sample(
    resp: list[int], reward: float | None, token_rewards: list[float] | None, *, prompt=(1, 2, 3), loss_mask=None
) -> dict:
    n = len(resp)
    return {
        "sample_id": f"s{resp}",
        "mode": "rl",
        "prompt_ids": list(prompt),
        "response_ids": resp,
        "rollout_logprobs": [-1.0] * n,
        "loss_mask": loss_mask or [1] * n,
        "reward": reward,
        "has_reward": reward is not None,
        "has_teacher": False,
        "teacher_logprobs": None,
        "teacher_topk": None,
        "token_rewards": token_rewards,
        "w_rl": 1.0,
        "w_opd": 1.0,
    }


def record(
    resp: list[int], reward: float | None, token_rewards: list[float] | None, *, prompt=(1, 2, 3), loss_mask=None
) -> Sample:
    """:func:`sample` read as the trainer reads a leased sample."""
    return Sample.model_validate(sample(resp, reward, token_rewards, prompt=prompt, loss_mask=loss_mask))


def yaml_file(
    tmp_path: Path, mode: str = "additive", *, enabled: bool = True, scorers: bool = True, extra: str = ""
) -> Path:
    lines = [
        "prm:",
        f"  enabled: {str(enabled).lower()}",
        "  advantage_shaping:",
        f"    mode: {mode}",
        "    negative_scale: 0.5",
        "    zero_penalty: 0.3",
        "    zero_eps: 0.01",
    ]
    if scorers:
        lines += [
            "  scorers:",
            "    - path: prm.scorers.LengthBudgetScorer",
            "      weight: 1.0",
            "      kwargs: {max_output_tokens: 4}",
        ]
    lines += ["actor:", "  token_rewards_as_adv: true"] + ([extra] if extra else [])
    p = tmp_path / f"prm-{mode}-{enabled}-{scorers}.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


# ----------------------------------------------------------------------------- sample -> tensors
@pytest.mark.unit
def test_collate_aligns_token_rewards_with_response_positions_and_flags_missing_ones():
    samples = [
        record([10, 11, 12], 1.0, [0.1, 0.2, 0.3], prompt=(1, 2)),
        record([20], -1.0, None, prompt=(1, 2, 3, 4)),
        record([30, 31], 1.0, [0.0, -0.5]),
    ]
    b = collate(samples)
    assert b.token_rewards.shape == b.response_ids.shape == b.rollout_lp.shape == (3, 3)
    torch.testing.assert_close(b.token_rewards, torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0], [0.0, -0.5, 0.0]]))
    assert b.has_token_rewards.tolist() == [True, False, True]
    # token t of sample i is predicted by the logit at P_i - 1 + t: the reward sits on the same response token
    assert b.response_ids[0].tolist() == [10, 11, 12] and b.resp_index[0].tolist() == [1, 2, 3]
    assert b.input_ids[0, b.resp_index[0] + 1].tolist() == [10, 11, 12]
    assert b.input_ids[2, b.resp_index[2, :2] + 1].tolist() == [30, 31]


@pytest.mark.unit
def test_check_sample_rejects_bad_token_rewards():
    assert check_sample(record([1, 2], 1.0, [0.5])) == "token_rewards has 1 entries for 2 response ids"
    assert "non-finite" in check_sample(record([1, 2], 1.0, [0.5, math.nan]))
    # a value that is not a number never reaches the loop: the lease's JSON edge sets the sample aside
    assert typed_samples([sample([1, 2], 1.0, [0.5, "x"])])[0] == []
    assert check_sample(record([1, 2], 1.0, [0.5, 1.5])) is None  # fine for additive / gvpo
    assert "[0, 1]" in check_sample(record([1, 2], 1.0, [0.5, 1.5]), shaping="process_weighted")
    # only loss-mask tokens must be in range (AReaL checks active tokens)
    assert check_sample(record([1, 2], 1.0, [0.5, 1.5], loss_mask=[1, 0]), shaping="process_weighted") is None
    assert check_sample(record([1, 2], 1.0, None), shaping="process_weighted") is None


def _advantages(samples: list[Sample], cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = collate(samples)
    rl = rl_sample_advantages(b.reward, b.has_reward, baseline=cfg.baseline, normalize=cfg.normalize_advantages)
    raw = outcome_advantages(b, b.rollout_lp, rl, cfg)
    return raw, shape(b, raw, cfg), token_advantages(b, b.rollout_lp, rl, cfg)


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["additive", "gvpo", "process_weighted"])
def test_shaping_applies_after_normalisation_only_to_samples_with_token_rewards(mode):
    samples = [
        record([10, 11, 12], 1.0, [0.5, 0.0, 1.0]),
        record([20, 21], -1.0, None),  # no token_rewards: unshaped
        record([30, 31, 32], -1.0, [0.25, 0.0, 0.5], loss_mask=[1, 1, 0]),
        record([40], 1.0, [0.0]),
    ]
    if mode == "gvpo":  # gvpo acts on negative process rewards
        samples[0].token_rewards = [-0.5, 0.0, -1.0]
        samples[2].token_rewards = [-0.25, 0.0, -0.5]
    cfg = TrainConfig(
        model_path="m",
        out_dir="o",
        baseline="batch_mean",
        normalize_advantages=True,
        shaping=mode,
        shaping_negative_scale=0.5,
        shaping_zero_penalty=0.3,
    )
    raw, shaped, routed = _advantages(samples, cfg)
    torch.testing.assert_close(routed, shaped)
    # outcome advantage: r - mean(r) over the batch, divided by its std (rewards +-1, mean 0, std 1)
    torch.testing.assert_close(raw[:, 0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(shaped[1], raw[1])  # no token_rewards -> unshaped
    assert shaped[2, 2] == 0 and shaped[1, 2] == 0  # loss mask 0 / padding stay 0
    a0, a2 = raw[0, 0].item(), raw[2, 0].item()
    if mode == "additive":
        expected0, expected2 = [a0 + 0.5, a0, a0 + 1.0], [a2 + 0.25, a2, 0.0]
    elif mode == "gvpo":  # failed tokens (p < 0): A > eps -> 0; A < -eps -> (1 + 0.5) A
        expected0, expected2 = [0.0, a0, 0.0], [1.5 * a2, a2, 0.0]
    else:  # A >= 0 -> A p; A < 0 -> p if p > 0 else A
        expected0, expected2 = [a0 * 0.5, 0.0, a0 * 1.0], [0.25, a2, 0.0]
    torch.testing.assert_close(shaped[0], torch.tensor(expected0), atol=1e-5, rtol=0)
    torch.testing.assert_close(shaped[2], torch.tensor(expected2), atol=1e-5, rtol=0)
    off = TrainConfig(model_path="m", out_dir="o", baseline="batch_mean", normalize_advantages=True)  # shaping none
    raw_off, _, routed_off = _advantages(samples, off)
    torch.testing.assert_close(raw_off, raw)
    torch.testing.assert_close(routed_off, raw)


# ----------------------------------------------------------------------------- config
@pytest.mark.unit
def test_prm_yaml_sets_shaping_through_the_judge_servers_loader(tmp_path):
    path = yaml_file(tmp_path, "gvpo", extra="  mask_no_eos_with_zero: true")
    cfg = resolve_prm_config(TrainConfig(model_path="m", out_dir="o", prm_config=str(path)))
    assert (cfg.shaping, cfg.shaping_negative_scale, cfg.shaping_zero_penalty, cfg.shaping_eps) == (
        "gvpo",
        0.5,
        0.3,
        0.01,
    )
    assert cfg.mask_no_eos_with_zero is True
    assert resolve_prm_config(cfg) == cfg  # idempotent (train() resolves again)
    # the CLI resolves too, and a flag equal to the file's value is not a conflict
    cli = parse_config(["--model-path", "m", "--out-dir", "o", "--prm-config", str(path), "--shaping", "gvpo"])
    assert cli.shaping == "gvpo" and cli.mask_no_eos_with_zero is True


@pytest.mark.unit
def test_prm_yaml_without_active_scorers_means_no_shaping(tmp_path):
    for path in (yaml_file(tmp_path, "additive", enabled=False), yaml_file(tmp_path, "additive", scorers=False)):
        assert resolve_prm_config(TrainConfig(model_path="m", out_dir="o", prm_config=str(path))).shaping == "none"


@pytest.mark.unit
def test_prm_yaml_errors_are_clear(tmp_path, capsys):
    path = yaml_file(tmp_path, "additive")
    with pytest.raises(ValueError, match=r"--shaping 'gvpo' contradicts 'additive'"):
        resolve_prm_config(TrainConfig(model_path="m", out_dir="o", prm_config=str(path), shaping="gvpo"))
    bad = yaml_file(tmp_path, "process_weighted", extra="  mask_no_eos_with_zero: true")
    with pytest.raises(PRMConfigError, match="mask_no_eos_with_zero"):
        resolve_prm_config(TrainConfig(model_path="m", out_dir="o", prm_config=str(bad)))
    with pytest.raises(SystemExit) as exc:
        parse_config(["--model-path", "m", "--out-dir", "o", "--prm-config", str(tmp_path / "missing.yaml")])
    assert exc.value.code == 2 and "cannot read PRM config" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the loop
class ListSource:
    """Serves fixed leases (samples + a PRM metrics window), as the policy server would."""

    def __init__(self, leases: list[Lease]):
        self.leases, self.acked, self.weight_updates = list(leases), [], []

    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease:
        return self.leases.pop(0)

    def ack(self, lease_id: str) -> None:
        self.acked.append(lease_id)

    def update_weights(self, model_path: str, weight_version: str, lineage: object = None) -> WeightsPushed:
        self.weight_updates.append((model_path, weight_version))
        return WeightsPushed(success=True, weight_version=weight_version, paused_s=0.0, state="live")


@pytest.mark.slow
def test_loop_logs_shaped_vs_unshaped_advantages_and_prm_window(tiny_model_dir, tmp_path):
    from engine.chat import load_tokenizer
    from trainer.train import train

    eos = load_tokenizer(str(tiny_model_dir)).eos_token_id
    good = [sample([100 + i, 200, eos], 1.0, [1.0, 1.0, 1.0], prompt=(5, 6, 7)) for i in range(3)]
    bad = [sample([300 + i, eos], -1.0, [0.0, 0.0], prompt=(5, 6, 7)) for i in range(3)]
    plain = [sample([400, eos], 1.0, None, prompt=(5, 6, 7))]
    for i, s in enumerate(good + bad + plain):
        s["sample_id"] = f"x{i}"
    window1 = {
        "rollout/prm_turn_reward/length_budget": 0.5,
        "rollout/prm_metric/turn/length_budget/within_budget/rate": 0.5,
    }
    window2 = {"rollout/prm_turn_reward/length_budget": 1.0}
    leases = [
        Lease("L1", [dict(s, sample_id="dup") for s in good[:1]], prm_metrics=window1),  # nothing trainable
        Lease("L2", good + bad + plain, prm_metrics=window2),
    ]
    leases[0].samples[0]["token_rewards"] = [1.0]  # wrong length -> not trained, its window carries over
    yml = yaml_file(tmp_path, "process_weighted")
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir=str(tmp_path / "out"),
        prm_config=str(yml),
        steps=1,
        batch_size=8,
        min_batch=1,
        micro_batch_size=8,
        lr=1e-3,
        progress=False,
    )
    src = ListSource(leases)
    assert train(cfg, source=src)["step"] == 1
    (m,) = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["shaping"] == "process_weighted"
    assert m["n_with_token_rewards"] == 6 and m["shaped_tokens"] == 3 * 3 + 3 * 2
    assert m["token_reward_mean"] == pytest.approx(9 / 15)
    # good: A > 0, p = 1 -> A; bad: A < 0, p = 0 -> A; plain: A > 0, unshaped. Here shaping keeps A exactly...
    assert m["adv_mean"] == pytest.approx(m["adv_unshaped_mean"], abs=1e-6)
    # ...while the outcome advantages are not zero (the statistic is not vacuous)
    assert m["adv_unshaped_abs_mean"] > 0.5
    assert m["rollout/prm_turn_reward/length_budget"] == 1.0 and m["prm_metrics_windows"] == 2
    assert m["rollout/prm_metric/turn/length_budget/within_budget/rate"] == 0.5
    assert src.acked == ["L1", "L2"] and src.weight_updates[-1][1] == "1"


@pytest.mark.slow
def test_loop_shaping_changes_advantages(tiny_model_dir, tmp_path):
    from trainer.train import train

    samples = [sample([100 + i, 200], 1.0 if i % 2 else -1.0, [0.5, 0.5], prompt=(5, 6, 7)) for i in range(4)]
    for i, s in enumerate(samples):
        s["sample_id"] = f"y{i}"
    cfg = TrainConfig(
        model_path=str(tiny_model_dir),
        out_dir=str(tmp_path / "out"),
        shaping="additive",
        steps=1,
        batch_size=4,
        micro_batch_size=4,
        lr=1e-3,
        progress=False,
        weight_sync=False,
    )
    train(cfg, source=ListSource([Lease("L", samples)]))
    (m,) = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # additive: every trained token gains +0.5 over the zero-mean outcome advantage
    assert m["adv_unshaped_mean"] == pytest.approx(0.0, abs=1e-6)
    assert m["adv_mean"] == pytest.approx(0.5, abs=1e-6)
    assert "prm_metrics_windows" not in m
