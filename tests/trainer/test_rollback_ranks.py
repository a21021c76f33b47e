"""After a rollback, two ranks restart from the restored weights (DDP replicas and FSDP2 shards alike), and checkpoint
pruning never deletes a version the server can restore, even while pushes are deferred behind a canary.

Contract (docs/SAFE_UPDATES.md "After a rollback: the trainer"): rank 0 pushes each checkpoint to the policy server;
when a push is refused because its parent was rolled back, rank 0 reads the ledger and broadcasts the restored
version's checkpoint, and EVERY rank loads it and clears Adam's moments, so the next step is Adam's first step from
the restored weights, on every replica or shard; the next push names the restored version as parent. A resume after
such a refusal (before the next checkpoint) reloads again on every rank; the run goes on and saves checkpoints.
``--keep-checkpoints`` (here its default, 3) keeps the newest checkpoints plus those of the live version and of
the canary on trial (trainer/lineage.py), so the version a dropped canary falls back to is still on disk.

Setup: ``hindsight-train`` with two ranks under torchrun (gloo on CPU) against tests.testkit.ledger_stub (the
trainer's admin API over the store's real weight-version ledger, safe updates on: a push becomes canary), two
launches:

- steps 1-5: version 1 is taken as canary and promoted just before the push of 2, which becomes canary; the pushes
  of 3 and 4 are deferred (2 is on trial) while checkpoints 3 and 4 are saved, so by step 4 version 1's
  step_000001 is older than the newest three; just before the push of 4 the canary is dropped (the ledger rolls
  back to 1), so that push (parent 2) is refused ``weights_rolled_back`` and every rank reloads step_000001,
  which pruning kept; step 5 trains from it, and just before its push (parent 1) the ledger rolls back to the
  initial weights (``base``): refused again, reloaded, and the launch ends there (as a crash right after a
  refusal would);
- step 6: the resume loads step_000005 (for FSDP2 its gathered optimizer state re-sharded), reloads ``base``
  instead of pushing step 5's rejected weights, trains step 6 and pushes it with parent ``base``.

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


def checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in out.glob("step_*"))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_reload_the_restored_version_after_a_refused_push(parallel, tiny_model_dir, sample_file, tmp_path):
    stub = start_ledger_stub(
        tmp_path, sample_file, tiny_model_dir, safe_updates=True, promote_before="2", roll_back_before="4:1,5:base"
    )
    key = tmp_path / "admin.key"
    key.write_text(ADMIN_KEY + "\n")
    out = tmp_path / "run"
    args = [
        *("--policy-url", stub.url, "--admin-api-key-file", str(key), "--http-deadline-s", "10"),
        *("--model-path", str(tiny_model_dir), "--out-dir", str(out), "--parallel", parallel),
        *("--batch-size", "4", "--micro-batch-size", "2", "--lr", str(LR), "--no-progress"),
        # one optimizer step per batch: the step after a reload is exactly one Adam step
        *("--ppo-epochs", "1", "--minibatches", "1"),
        *("--max-staleness", "-1"),  # the samples' weight versions are not this run's
    ]
    step1 = (out / "step_000001").resolve()
    names = parameter_names(tiny_model_dir)
    try:
        r = run_cli([*args, "--steps", "5"], nproc=2)
        assert r.returncode == 0, r.output[-3000:]
        assert pushes(stub) == [("1", None, 200), ("2", "1", 200), ("3", "2", 409), ("4", "2", 409), ("5", "1", 409)]
        assert sum(c["path"] == "/admin/weights" for c in calls_of(stub)) == 3  # the ledger read after each refusal
        assert "weights of step 3 not published now" in r.output
        for rank in (0, 1):  # each rank logs its reload (a warning: rank 1 logs warnings too)
            assert f"[rank{rank}] WARNING trainer.train: step 4: weights reloaded from {step1};" in r.output
            assert f"[rank{rank}] WARNING trainer.train: step 5: weights reloaded from {tiny_model_dir};" in r.output
        # step 2 (the dropped canary) pruned once 1 was restored; 1 kept while it was live and after its restore
        assert checkpoint_steps(out) == [1, 3, 4, 5]
        lineage = {
            "published": BASE_VERSION,
            "published_checkpoint": str(tiny_model_dir),
            "fallback_checkpoint": None,
            "reload": {"step": 5, "checkpoint": str(tiny_model_dir)},
        }
        assert json.loads((out / LINEAGE_FILE).read_text()) == lineage
        if parallel == "fsdp2":
            assert "fsdp2: sharded 2 decoder layers + root over 2 ranks" in r.output
        w1, w4, w5 = (load_file(str(out / f"step_{s:06d}" / "model.safetensors")) for s in (1, 4, 5))
        after_reload = first_adam_step(w1, out / "step_000005", names)

        r = run_cli([*args, "--steps", "6"], nproc=2)
        assert r.returncode == 0, r.output[-3000:]
        assert f"resumed from {out / 'step_000005'}" in r.output
        for rank in (0, 1):
            assert f"[rank{rank}] WARNING trainer.train: step 5: weights reloaded from {tiny_model_dir};" in r.output
        assert pushes(stub)[5:] == [("6", BASE_VERSION, 200)]  # step 5's rejected weights never pushed again
        assert checkpoint_steps(out) == [4, 5, 6]  # 1 is retired now: only the newest three
        step6 = str((out / "step_000006").resolve())
        lineage = {
            "published": "6",
            "published_checkpoint": step6,
            "fallback_checkpoint": str(tiny_model_dir),  # 6 is canary: dropping it restores base
            "reload": None,
        }
        assert json.loads((out / LINEAGE_FILE).read_text()) == lineage
    finally:
        stub.stop()

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    if parallel == "ddp":
        assert [m["ddp_weight_spread"] for m in metrics] == [0.0] * 6  # the replicas agree after each reload
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    w6 = load_file(str(out / "step_000006" / "model.safetensors"))
    after_resume = first_adam_step(base, out / "step_000006", names)
    for after, expected, ckpt in ((w5, after_reload, "step_000005"), (w6, after_resume, "step_000006")):
        mismatched = [k for k in after if not torch.equal(after[k], expected[k])]
        assert not mismatched, (ckpt, mismatched, max(float((after[k] - expected[k]).abs().max()) for k in mismatched))
    # The check can fail: from the rejected weights the same step lands far away.
    wrong = first_adam_step(w4, out / "step_000005", names)
    assert max(float((w5[k] - wrong[k]).abs().max()) for k in w5) > LR / 10
