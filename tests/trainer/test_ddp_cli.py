"""``hindsight-train`` as a real process: CLI validation, and DDP under torchrun (gloo on CPU).

Contract under test (issue 6 item 4): two ranks on the same batches end with identical weights (the loop
all-gathers a weight checksum every step and fails on any spread) and the same loss and weights as one
process on the same batches, because the loss is normalised by the whole batch's valid tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_cli(args: list[str], *, nproc: int = 0, timeout_s: float = 150) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    cmd = [*launcher, "-m", "trainer.cli", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.unit
def test_cli_rejects_inconsistent_flags():
    r = subprocess.run([sys.executable, "-m", "trainer.cli", "--model-path", "m", "--out-dir", "o", "--shaping", "process_weighted",
                        "--mask-no-eos-with-zero"], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "incompatible with mask_no_eos_with_zero" in r.stderr
    r = subprocess.run([sys.executable, "-m", "trainer.cli", "--model-path", "m", "--out-dir", "o", "--aggregation", "sum"],
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.unit
def test_cli_unreachable_policy_server_fails_explicitly(tiny_model_dir, tmp_path):
    from engine.procs import free_port

    r = run_cli(["--policy-url", f"http://127.0.0.1:{free_port()}", "--admin-api-key", "k", "--model-path", str(tiny_model_dir),
                 "--out-dir", str(tmp_path / "o"), "--http-deadline-s", "1", "--no-progress"], timeout_s=90)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "training stopped" in r.stderr and "failed after" in r.stderr


@pytest.mark.e2e
def test_ddp_two_ranks_match_one_process(tiny_model_dir, sample_file, tmp_path):
    common = ["--samples-file", str(sample_file), "--model-path", str(tiny_model_dir), "--steps", "2", "--batch-size", "8",
              "--micro-batch-size", "2", "--lr", "1e-2", "--no-progress", "--no-weight-sync", "--aggregation", "token_mean"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    r1 = run_cli([*common, "--out-dir", str(single)])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_cli([*common, "--out-dir", str(ddp)], nproc=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    m1 = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (ddp / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((ddp / "config.json").read_text())["world_size"] == 2
    assert [m["ddp_weight_spread"] for m in m2] == [0.0, 0.0]  # both ranks hold bit-identical weights
    for a, b in zip(m1, m2):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["n_tokens"] == a["n_tokens"]
        # Adam hides a gradient scale error in the weights; the pre-clip gradient norm does not.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1 = load_file(str(single / "step_000002" / "model.safetensors"))
    w2 = load_file(str(ddp / "step_000002" / "model.safetensors"))
    w0 = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
