"""After a rollback, two ranks restart from the restored weights (DDP replicas and FSDP2 shards alike).

Contract (docs/SAFE_UPDATES.md "After a rollback: the trainer"): rank 0 pushes each checkpoint to the policy server;
when a push is refused because its parent was rolled back, rank 0 reads the ledger and broadcasts the restored
version's checkpoint, and EVERY rank loads it and clears Adam's moments, so the next step is Adam's first step from
the restored weights, on every replica or shard; the next push names the restored version as parent. A resume after
such a refusal (before the next checkpoint) reloads again on every rank; the run goes on and saves checkpoints.

Setup: ``hindsight-train`` with two ranks under torchrun (gloo on CPU) against tests.testkit.ledger_stub (the
trainer's admin API over the store's real weight-version ledger), two launches:

- steps 1-4: versions 1 and 2 are taken; just before the push of 3 the ledger rolls back to 1, so that push
  (parent 2) is refused ``weights_rolled_back`` and every rank reloads step_000001 (version 1's checkpoint, which
  ``--keep-checkpoints`` keeps on disk); step 4 trains from it, and just before its push (parent 1) the ledger
  rolls back to the initial weights (``base``): refused again, reloaded, and the launch ends there (as a crash
  right after a refusal would);
- step 5: the resume loads step_000004 (for FSDP2 its gathered optimizer state re-sharded), reloads ``base``
  instead of pushing step 4's rejected weights, trains step 5 and pushes it with parent ``base``.

How "every rank reloaded exactly" is seen from outside: a checkpoint holds the full weights (under FSDP2 gathered
from both ranks' shards) and the full Adam state. With cleared moments, the step after a reload is Adam's first:
``step == 1`` and w' = w - lr / (1 - beta1) * m / (sqrt(v) / sqrt(1 - beta2) + eps), computed here with torch's
own AdamW operations from the saved m and v and the RESTORED weights w, must give the saved w' bit for bit. A
shard (or replica) that kept the rejected weights (steps away from w) or its moments (another step count, other m
and v) breaks that equality; DDP's per-step weight checksum across ranks also fails the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.testkit.ledger_stub import BASE_VERSION, calls_of, start_ledger_stub
from tests.testkit.servers import ADMIN_KEY
from tests.testkit.trainer_cli import run_trainer_cli as run_cli
from trainer.lineage import LINEAGE_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LR = 1e-2


def pushes(stub) -> list[tuple[str, str | None, int]]:
    """(version, parent_version, answer status) of every push the stub answered, in order."""
    return [
        (c["body"]["weight_version"], c["body"].get("parent_version"), c["status"])
        for c in calls_of(stub)
        if c["path"] == "/admin/weights/update"
    ]


def parameter_names(model_dir: Path) -> list[str]:
    """The model's parameter names in ``parameters()`` order (the indices of a ``torch`` optimizer state)."""
    from transformers import AutoModelForCausalLM

    return [n for n, _ in AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters()]


def first_adam_step(before: dict[str, torch.Tensor], ckpt: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The weights one AdamW step (Adam's FIRST: the moments were empty) takes ``before`` to, with the moments saved
    in ``ckpt``'s optimizer.pt (either format), computed as torch's AdamW computes it; asserts ``step == 1``."""
    blob = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    state, [group] = blob["optimizer"]["state"], blob["optimizer"]["param_groups"]
    if blob["format"] == "torch":  # keyed by index into parameters(); fqn_full is keyed by name
        state = {names[i]: s for i, s in state.items()}
    assert state and set(state) <= set(before), sorted(set(state) - set(before))
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    after = {}
    for name, w in before.items():
        s = state.get(name)
        if s is None:  # a tied duplicate (saved once) or a parameter without a gradient
            after[name] = w
            continue
        assert float(s["step"]) == 1.0, (name, float(s["step"]))
        decayed = w * (1 - lr * wd)  # torch's order of operations, with its bias corrections at step 1.0
        denom = (s["exp_avg_sq"].sqrt() / (1 - beta2**1.0) ** 0.5).add_(eps)
        after[name] = decayed.addcdiv(s["exp_avg"], denom, value=-(lr / (1 - beta1**1.0)))
    return after


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_reload_the_restored_version_after_a_refused_push(parallel, tiny_model_dir, sample_file, tmp_path):
    stub = start_ledger_stub(tmp_path, sample_file, tiny_model_dir, roll_back_before="3:1,4:base")
    key = tmp_path / "admin.key"
    key.write_text(ADMIN_KEY + "\n")
    out = tmp_path / "run"
    args = [
        *("--policy-url", stub.url, "--admin-api-key-file", str(key), "--http-deadline-s", "10"),
        *("--model-path", str(tiny_model_dir), "--out-dir", str(out), "--parallel", parallel),
        *("--batch-size", "4", "--micro-batch-size", "2", "--lr", str(LR), "--no-progress"),
        # one optimizer step per batch: the step after a reload is exactly one Adam step
        *("--ppo-epochs", "1", "--minibatches", "1"),
        # the samples' weight versions are not this run's; the restored step_000001 must outlive steps 2-4
        *("--max-staleness", "-1", "--keep-checkpoints", "8"),
    ]
    step1 = (out / "step_000001").resolve()
    try:
        r = run_cli([*args, "--steps", "4"], nproc=2)
        assert r.returncode == 0, r.output[-3000:]
        assert pushes(stub) == [("1", None, 200), ("2", "1", 200), ("3", "2", 409), ("4", "1", 409)]
        assert sum(c["path"] == "/admin/weights" for c in calls_of(stub)) == 2  # the ledger read after each refusal
        for rank in (0, 1):  # each rank logs its reload (a warning: rank 1 logs warnings too)
            assert f"[rank{rank}] WARNING trainer.train: step 3: weights reloaded from {step1};" in r.output
            assert f"[rank{rank}] WARNING trainer.train: step 4: weights reloaded from {tiny_model_dir};" in r.output
        lineage = {"published": BASE_VERSION, "reload": {"step": 4, "checkpoint": str(tiny_model_dir)}}
        assert json.loads((out / LINEAGE_FILE).read_text()) == lineage
        if parallel == "fsdp2":
            assert "fsdp2: sharded 2 decoder layers + root over 2 ranks" in r.output

        r = run_cli([*args, "--steps", "5"], nproc=2)
        assert r.returncode == 0, r.output[-3000:]
        assert f"resumed from {out / 'step_000004'}" in r.output
        for rank in (0, 1):
            assert f"[rank{rank}] WARNING trainer.train: step 4: weights reloaded from {tiny_model_dir};" in r.output
        assert pushes(stub)[4:] == [("5", BASE_VERSION, 200)]  # step 4's rejected weights never pushed again
        assert json.loads((out / LINEAGE_FILE).read_text()) == {"published": "5", "reload": None}
    finally:
        stub.stop()

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    if parallel == "ddp":
        assert [m["ddp_weight_spread"] for m in metrics] == [0.0] * 5  # the replicas agree after each reload
    names = parameter_names(tiny_model_dir)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    w1, w3, w4, w5 = (load_file(str(out / f"step_{s:06d}" / "model.safetensors")) for s in (1, 3, 4, 5))
    for before, after, ckpt in ((w1, w4, "step_000004"), (base, w5, "step_000005")):
        expected = first_adam_step(before, out / ckpt, names)
        mismatched = [k for k in after if not torch.equal(after[k], expected[k])]
        assert not mismatched, (ckpt, mismatched, max(float((after[k] - expected[k]).abs().max()) for k in mismatched))
    # The check can fail: from the rejected weights the same step lands far away.
    wrong = first_adam_step(w3, out / "step_000004", names)
    assert max(float((w4[k] - wrong[k]).abs().max()) for k in w4) > LR / 10
