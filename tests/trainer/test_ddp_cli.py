"""``hindsight-train`` as a real process: CLI validation, and DDP under torchrun (gloo on CPU).

Contract under test: two ranks on the same batches end with identical weights (the loop
all-gathers a weight checksum every step and fails on any spread) and the same loss and weights as one
process on the same batches, because the loss is normalised by the whole batch's valid tokens. The same
holds for ``--parallel fsdp2`` (sharded parameters, full state gathered on rank 0 for the checkpoint), also
across a resume that restores the sharded optimizer state. These runs use ``--rollout-correction mis`` on samples
a third of which come from a much "hotter" behaviour policy: after mis rejects tokens, each minibatch's valid-token
and sample counts are all-reduced across ranks (trainer/old_pass.py's old-log-prob pass), so the rejected tokens
leave the GLOBAL denominators on every rank and the equalities above still hold, with the same masked fraction.
The DDP reference run starts its ranks as launch/trainer.sh does (``torchrun -m trainer.cli``); the FSDP2 runs have
torchrun fork them (tests.testkit.trainer_cli: the same CLI in each rank, its imports already done).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.numerics import reorder_atol, step_loss_terms
from tests.testkit.trainer_cli import SMALL_BATCH_FLAGS, trainer_env
from tests.testkit.trainer_cli import run_trainer_cli as run_cli


@pytest.mark.process
def test_cli_rejects_inconsistent_flags():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "--model-path",
            "m",
            "--out-dir",
            "o",
            "--shaping",
            "process_weighted",
            "--mask-no-eos-with-zero",
        ],
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "incompatible with mask_no_eos_with_zero" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "--model-path", "m", "--out-dir", "o", "--aggregation", "sum"],
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.process
def test_cli_unreachable_policy_server_fails_explicitly(tiny_model_dir, tmp_path):
    from tests.testkit.procs import free_port

    key_file = tmp_path / "admin.key"
    key_file.write_text("k\n")
    r = run_cli(
        [
            "--policy-url",
            f"http://127.0.0.1:{free_port()}",
            "--admin-api-key-file",
            str(key_file),
            "--model-path",
            str(tiny_model_dir),
            "--out-dir",
            str(tmp_path / "o"),
            "--http-deadline-s",
            "1",
            "--no-progress",
        ],
        timeout_s=90,
    )
    assert r.returncode == 1, r.output[-2000:]
    assert "training stopped" in r.output and "failed after" in r.output


COMMON = [
    "--steps",
    "3",
    *SMALL_BATCH_FLAGS,
    "--aggregation",
    "token_mean",
    # One optimizer step per batch: ranks sum gradients in another order than one process, and each further
    # Adam step on the same batch compounds that float rounding past the weight tolerance below.
    "--ppo-epochs",
    "1",
    "--rollout-correction",
    "mis",
]


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (appended when absent)."""
    if flag not in args:
        return [*args, flag, value]
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


def metrics_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hot_sample_file(sample_file, tmp_path_factory) -> Path:
    """The 24 samples with every third one from a much "hotter" behaviour: its rollout log-probs 4 lower, so the
    importance weight e^4 > 2 makes mis reject its tokens."""
    rows = [json.loads(x) for x in sample_file.read_text().splitlines() if x.strip()]
    for i, s in enumerate(rows):
        if i % 3 == 0:
            s["rollout_logprobs"] = [lp - 4.0 for lp in s["rollout_logprobs"]]
    path = tmp_path_factory.mktemp("hot-samples") / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in rows))
    return path


@pytest.fixture(scope="module")
def reference_runs(tiny_model_dir, hot_sample_file, tmp_path_factory) -> dict[str, Path]:
    """One process and two DDP ranks over the same 3 batches (shared by the DDP and FSDP2 tests)."""
    root = tmp_path_factory.mktemp("runs")
    common = ["--samples-file", str(hot_sample_file), "--model-path", str(tiny_model_dir), *COMMON]
    out = {"single": root / "single", "ddp": root / "ddp"}
    r1 = run_cli([*common, "--out-dir", str(out["single"])])
    assert r1.returncode == 0, r1.output[-3000:]
    # Ranks started as launch/trainer.sh starts them (torchrun -m trainer.cli); the FSDP2 runs fork theirs. Its
    # 4 samples per rank in one micro-batch make each step on-policy: the update's forward is also its old-log-prob
    # pass (trainer/old_pass.py), checked against one process's separate pass over 4 micro-batches.
    ddp = with_flag([*common, "--out-dir", str(out["ddp"])], "--micro-batch-size", "4")
    r2 = run_cli(ddp, nproc=2, fork_ranks=False)
    assert r2.returncode == 0, r2.output[-3000:]
    return out


def assert_same_training(m1: list[dict], m2: list[dict], model_dir: Path, sample_file: Path) -> None:
    assert [m["step"] for m in m2] == [m["step"] for m in m1] == [1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        assert a["rollout_is_masked_frac"] > 0.1  # the hot samples' tokens were rejected
        assert b["rollout_is_masked_frac"] == pytest.approx(a["rollout_is_masked_frac"])
        # The scale is the terms' (advantage times a ratio near 1), not the mean's: they may cancel to ~0.
        scale = max(abs(a["loss"]), a["adv_abs_mean"])
        atol = reorder_atol(step_loss_terms(model_dir, sample_file, a["n_tokens"]), scale)
        assert b["loss"] == pytest.approx(a["loss"], abs=atol)
        assert b["n_tokens"] == a["n_tokens"]
        # Adam hides a gradient scale error in the weights; the pre-clip gradient norm does not.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


LR = float(SMALL_BATCH_FLAGS[SMALL_BATCH_FLAGS.index("--lr") + 1])


def assert_same_weights(a: Path, b: Path) -> None:
    """The same weights up to the rounding of reordered gradient sums, as Adam passes it on.

    Adam moves each weight by lr * m/sqrt(v): a relative rounding error in the gradient stays that small in most
    weights, but where a weight's gradients nearly cancel across steps the ratio amplifies it (measured on two
    tiny architectures: 1 of 178,304 and 3 of 141,376 weights beyond 1e-5, the largest 1.8e-5, an old fixed
    tolerance of 1e-5 + 1e-4 relative failed on one of them). A real divergence (a wrong gradient, a skipped or
    repeated step) moves weights by a sizeable fraction of lr, so: every weight within lr/100, and all but one in
    10,000 within 1e-5.
    """
    w1, w2 = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(w1) == sorted(w2)  # same HF layout (tied lm_head stored once)
    diff = torch.cat([(w2[k] - w1[k]).abs().flatten() for k in w1])
    assert float(diff.max()) <= LR / 100, float(diff.max())
    assert int((diff > 1e-5).sum()) <= diff.numel() // 10_000, int((diff > 1e-5).sum())


@pytest.mark.e2e
def test_ddp_two_ranks_match_one_process(tiny_model_dir, hot_sample_file, reference_runs):
    single, ddp = reference_runs["single"], reference_runs["ddp"]
    m1, m2 = metrics_of(single), metrics_of(ddp)
    assert json.loads((ddp / "config.json").read_text())["world_size"] == 2
    assert [m["old_pass_fused"] for m in m1] == [0, 0, 0] and [m["old_pass_fused"] for m in m2] == [1, 1, 1]
    assert [m["ddp_weight_spread"] for m in m2] == [0.0, 0.0, 0.0]  # both ranks hold bit-identical weights
    assert_same_training(m1, m2, tiny_model_dir, hot_sample_file)
    assert_same_weights(single / "step_000003", ddp / "step_000003")
    w1 = load_file(str(single / "step_000003" / "model.safetensors"))
    w0 = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.e2e
@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_process_and_ddp_across_a_resume(
    tiny_model_dir, hot_sample_file, reference_runs, tmp_path
):
    """--parallel fsdp2 (fully_shard per decoder layer + root, gloo): same losses and gradient norms as one process,
    the same saved weights as DDP; steps 1-2, then a resume (sharded optimizer state restored from the gathered
    full state) for step 3, so a wrong optimizer gather/restore shows in step 3's weights."""
    out = tmp_path / "fsdp2"
    common = [
        "--samples-file",
        str(hot_sample_file),
        "--model-path",
        str(tiny_model_dir),
        *COMMON,
        "--parallel",
        "fsdp2",
        "--out-dir",
        str(out),
    ]
    r = run_cli([*common[: common.index("--steps") + 1], "2", *common[common.index("--steps") + 2 :]], nproc=2)
    assert r.returncode == 0, r.output[-3000:]
    assert "fsdp2: sharded 2 decoder layers + root over 2 ranks" in r.output
    blob = torch.load(out / "step_000002" / "optimizer.pt", weights_only=False)
    assert blob["format"] == "fqn_full" and blob["optimizer"]["state"]
    r = run_cli(common, nproc=2)
    assert r.returncode == 0, r.output[-3000:]
    assert "resumed from" in r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["parallel"] == "fsdp2" and cfg["world_size"] == 2
    m = metrics_of(out)
    assert all("ddp_weight_spread" not in x for x in m)  # no replicas to compare under fsdp2
    assert_same_training(metrics_of(reference_runs["single"]), m, tiny_model_dir, hot_sample_file)
    assert_same_weights(reference_runs["ddp"] / "step_000003", out / "step_000003")
    assert_same_weights(reference_runs["single"] / "step_000003", out / "step_000003")
    # The gathered (fqn_full) optimizer state is never loaded as a DDP one, nor silently dropped.
    r = run_cli([*common[: common.index("--parallel")], *common[common.index("--parallel") + 2 :], "--steps", "4"])
    assert r.returncode == 1 and "cannot resume from" in r.output and "format 'fqn_full'" in r.output, r.output[-2000:]


@pytest.mark.e2e
def test_ddp_on_policy_steps_without_a_gradient_are_skipped(tiny_model_dir, hot_sample_file, tmp_path):
    """One epoch and one micro-batch per rank: each step's forward is also its old-log-prob pass. The first two
    batches (every reward +1: A = 0 against the running mean) are skipped after that forward on both ranks, a
    forward with no backward, and the third (rewards +-1) still trains under DDP."""
    rows = [json.loads(x) for x in hot_sample_file.read_text().splitlines() if x.strip()]
    for i, s in enumerate(rows):
        s.update(reward=1.0 if i < 16 or i % 2 else -1.0, has_reward=True)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(s) + "\n" for s in rows))
    out = tmp_path / "run"
    args = ["--samples-file", str(samples), "--model-path", str(tiny_model_dir), *COMMON, "--out-dir", str(out)]
    r = run_cli(with_flag(args, "--micro-batch-size", "4"), nproc=2)
    assert r.returncode == 0, r.output[-3000:]
    [line] = metrics_of(out)
    assert line["step"] == 1 and line["skipped_steps"] == 2 and line["old_pass_fused"] == 1, line
    assert line["ddp_weight_spread"] == 0.0


@pytest.mark.unit
def test_optimizer_state_format_mismatch_is_an_error():
    from trainer.parallel import load_optimizer_state

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="format 'fqn_full'.*--parallel ddp"):
        load_optimizer_state(model, opt, {"state": {}, "param_groups": []}, "fqn_full", "ddp", 1)
    with pytest.raises(ValueError, match="format 'torch'.*--parallel fsdp2"):
        load_optimizer_state(model, opt, opt.state_dict(), "torch", "fsdp2", 2)
    load_optimizer_state(model, opt, opt.state_dict(), "torch", "fsdp2", 1)  # one process: nothing is sharded
