"""Merged session trajectories train exactly like separate samples (engine/trajectories.py, trainer/batch.py).

A token-continuous session (each turn's prompt = previous prompt + sampled reply + new message ids) is run as
one row instead of one per turn. For rl, opd and combine the per-token log-probs, advantages, loss and
gradient are the same to float tolerance, and the loss matches a hand computation; a whole trainer step
(``train_on_batch``) moves the weights the same way while its forward pass runs far fewer tokens.

The two layouts pad and attend over rows of other lengths, so they round differently: each comparison uses
``tests.numerics.reorder_atol`` for the reductions its value went through (``forward_terms``: the forward
pass; plus the batch's tokens for the loss and the gradients), never a constant tuned on one machine.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.records import Sample
from engine.trajectories import forward_tokens, merged_trajectories, plan_rows
from tests.numerics import assert_reordered_close, forward_terms, reorder_atol
from tests.trainer.conftest import records, train_config
from trainer.advantages import RunningMean
from trainer.batch import collate, score_responses
from trainer.objective import micro_loss, old_logprobs, token_advantages
from trainer.update import train_on_batch


def _session(rng: random.Random, sid: str, turns: int, mode: str, prompt_len: int = 40) -> list[dict[str, Any]]:
    prompt = [rng.randrange(10, 1000) for _ in range(prompt_len)]
    out = []
    for k in range(turns):
        resp = [rng.randrange(10, 1000) for _ in range(rng.randint(3, 6))]
        n = len(resp)
        out.append(
            {
                "sample_id": f"{sid}-{k}",
                "session_id": sid,
                "turn_index": k,
                "mode": mode,
                "prompt_ids": list(prompt),
                "response_ids": resp,
                "rollout_logprobs": [-rng.uniform(3, 8) for _ in range(n)],
                "loss_mask": [1] * n,
                "reward": rng.choice([1.0, -1.0]),
                "has_reward": mode != "opd",
                "teacher_logprobs": [-rng.uniform(1, 9) for _ in range(n)] if mode != "rl" else None,
                "has_teacher": mode != "rl",
                "w_rl": 0.5,
                "w_opd": 2.0,
            }
        )
        prompt = prompt + resp + [rng.randrange(10, 1000) for _ in range(rng.randint(2, 5))]
    return out


def _batch(mode: str) -> list[Sample]:
    rng = random.Random(7)
    samples = _session(rng, "a", 4, mode) + _session(rng, "b", 3, mode)
    rogue = dict(_session(rng, "a", 1, mode, prompt_len=12)[0], sample_id="a-x", turn_index=9)  # not a continuation
    return records([samples[0], samples[4], samples[1], rogue, samples[5], samples[2], samples[6], samples[3]])


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_rows_follow_continuity():
    samples = _batch("rl")
    rows = plan_rows(samples)
    ids = [[samples[i].sample_id for i in r] for r in rows]
    assert ids == [["a-0", "a-1", "a-2", "a-3"], ["b-0", "b-1", "b-2"], ["a-x"]]
    merged = merged_trajectories(samples)
    assert [t.session_id for t in merged] == ["a", "b"]
    for t in merged:
        for turn in t.turns:
            s = next(x for x in samples if x.sample_id == turn.sample_id)
            start, n = turn.response_start, turn.response_len
            assert t.token_ids[start : start + n] == s.response_ids
            assert t.token_ids[:start] == s.prompt_ids
    assert forward_tokens(samples, rows) < forward_tokens(samples, [[i] for i in range(len(samples))])
    assert len(plan_rows(samples, [i != 2 for i in range(len(samples))])) == 4  # ineligible: its own row


@pytest.mark.parametrize("mode", ["rl", "opd", "combine"])
def test_same_per_token_loss_and_gradient(model: torch.nn.Module, mode: str) -> None:
    samples = _batch(mode)
    cfg = train_config(advantage_mode="sample", old_logprobs="rollout", rollout_correction="none")
    rl_adv = torch.tensor([float(s.reward) - 0.25 for s in samples])
    results = {}
    for merge in (False, True):
        b = collate(samples, merge=merge)
        assert b.input_ids.shape[0] == (3 if merge else len(samples))
        old = old_logprobs(model, b, cfg)
        adv = token_advantages(b, old.adv, rl_adv, cfg)
        n_tok = float(b.mask.sum())
        model.zero_grad()
        loss, _ = micro_loss(model, None, b, old.pg, adv, cfg, num_tokens=n_tok, num_seqs=len(samples))
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            lp = score_responses(model, b, with_entropy=False).logprobs
        results[merge] = (lp, adv, loss.detach(), grads, b.mask, n_tok, b.input_ids.shape)
    (lp0, adv0, loss0, g0, mask, n_tok, _), (lp1, adv1, loss1, g1, _, _, _) = results[False], results[True]
    shapes = [r[6] for r in results.values()]
    fwd = forward_terms(model.config, max(shape[1] for shape in shapes))
    # loss and gradients add the batch's positions (the token mean; each weight gradient sums over every
    # position) on top of the forward pass each term came through.
    total = fwd + max(shape.numel() for shape in shapes)
    assert_reordered_close(lp1 * mask, lp0 * mask, n_terms=fwd, msg="log-probs")
    assert_reordered_close(adv1, adv0, n_terms=fwd, msg="advantages")
    term_scale = float(adv0.abs().max())  # each loss term is an advantage times a ratio near 1; they cancel
    assert_reordered_close(loss1, loss0, n_terms=total, scale=term_scale, msg="loss")
    assert len(g0) == len(g1)
    for i, (a, b) in enumerate(zip(g0, g1, strict=True)):
        assert_reordered_close(b, a, n_terms=total, msg=f"gradient {i}")
    # Hand check, from each sample's own forward pass (no batching, no padding): its response log-probs ...
    with torch.no_grad():
        for i, s in enumerate(samples):
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            own = torch.log_softmax(model(input_ids=seq).logits[0].float(), dim=-1)
            p = len(s.prompt_ids)
            want = own[p - 1 : p - 1 + len(s.response_ids)].gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert_reordered_close(lp1[i, : len(want)], want, n_terms=fwd, msg=f"sample {i} alone")
    # ... and PPO-clip with old = rollout log-probs, no correction, token mean over the batch.
    expected = torch.tensor(0.0)
    for i, s in enumerate(samples):
        for t, rlp in enumerate(s.rollout_logprobs):
            ratio = torch.exp(lp0[i, t] - rlp)
            a = {
                "rl": rl_adv[i],
                "opd": s.teacher_logprobs[t] - rlp if s.teacher_logprobs else 0.0,
                "combine": (s.w_opd * (s.teacher_logprobs[t] - rlp) + s.w_rl * rl_adv[i])
                if s.teacher_logprobs
                else 0.0,
            }[mode]
            a = torch.as_tensor(a, dtype=torch.float32)
            expected = expected + torch.max(-a * ratio, -a * torch.clamp(ratio, 1 - 0.2, 1 + 0.28))
    assert_reordered_close(loss1, expected / n_tok, n_terms=total, scale=term_scale, msg="hand-computed loss")


def test_a_trainer_step_moves_the_weights_the_same_way(tiny_model_dir: Path) -> None:
    samples = _batch("combine")
    after = {}
    for merge in (False, True):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        cfg = train_config(
            micro_batch_size=8, merge_trajectories=merge, max_grad_norm=0.0, rollout_correction="none", ppo_epochs=1
        )  # one pass: a second epoch at lr 1 would amplify float32 rounding, not test the merge
        metrics = train_on_batch(
            m, m, None, opt, samples, [False] * len(samples), cfg, RunningMean(0.9), 0, 1, torch.device("cpu"), None
        )
        after[merge] = ([p.detach().clone() for p in m.parameters()], metrics)
    (p0, m0), (p1, m1) = after[False], after[True]
    # SGD at lr 1: the weights differ by the gradients' rounding (scaled here by the weights' magnitude, which
    # bounds the gradients' and adds the subtraction's own ulp). Adam would divide near-zero gradients by
    # themselves and turn that rounding into differences of up to lr.
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)  # bounds any row and the batch
    total = forward_terms(m.config, tokens) + tokens
    for i, (a, b) in enumerate(zip(p0, p1, strict=True)):
        assert_reordered_close(b, a, n_terms=total, msg=f"parameter {i}")
    assert m0["loss"] == pytest.approx(m1["loss"], abs=reorder_atol(total, max(abs(m0["loss"]), m0["adv_abs_mean"])))
    assert m0["separate_tokens_per_turn"] == m1["separate_tokens_per_turn"] == m0["forward_tokens_per_turn"]
    assert m1["forward_tokens_per_turn"] < 0.5 * m0["forward_tokens_per_turn"]
