"""``--rollout-correction mis`` under torchrun: rejected tokens leave the GLOBAL denominators on every rank.

Contract under test (trainer/train.py old-log-prob pass): after mis rejects tokens, each minibatch's valid-token
and sample counts are all-reduced across ranks, so two DDP ranks give the same loss, token count, gradient norm
and weights as one process on the same batches, with the same masked fraction.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.numerics import reorder_atol, step_loss_terms
from tests.testkit.trainer_cli import SMALL_BATCH_FLAGS
from tests.testkit.trainer_cli import run_trainer_cli as run_cli
from tests.trainer.conftest import write_samples


@pytest.mark.slow
def test_mis_two_ranks_match_one_process(tiny_model_dir, tmp_path):
    path = tmp_path / "samples.jsonl"
    samples = write_samples(tiny_model_dir, path, 16, seed=7)
    for i, s in enumerate(
        samples
    ):  # every third sample comes from a much "hotter" behaviour: w = e^4 > 2 on its tokens
        if i % 3 == 0:
            s["rollout_logprobs"] = [lp - 4.0 for lp in s["rollout_logprobs"]]
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    common = [
        "--samples-file",
        str(path),
        "--model-path",
        str(tiny_model_dir),
        "--steps",
        "2",
        *SMALL_BATCH_FLAGS,
        "--rollout-correction",
        "mis",
    ]
    outs = {}
    for name, nproc in (("single", 0), ("ddp", 2)):
        outs[name] = tmp_path / name
        r = run_cli([*common, "--out-dir", str(outs[name])], nproc=nproc)
        assert r.returncode == 0, r.output[-3000:]
    m1, m2 = ([json.loads(x) for x in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in ("single", "ddp"))
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2]
    for a, b in zip(m1, m2, strict=True):
        assert a["rollout_is_masked_frac"] > 0.1  # the shifted samples' tokens were rejected
        assert b["rollout_is_masked_frac"] == pytest.approx(a["rollout_is_masked_frac"])
        assert b["n_tokens"] == a["n_tokens"]
        scale = max(abs(a["loss"]), a["adv_abs_mean"])  # the terms' magnitude: the mean may cancel to ~0
        assert b["loss"] == pytest.approx(
            a["loss"], abs=reorder_atol(step_loss_terms(tiny_model_dir, path, a["n_tokens"]), scale)
        )
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1, w2 = (load_file(str(outs[n] / "step_000002" / "model.safetensors")) for n in ("single", "ddp"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)  # Adam amplifies float noise near 0
