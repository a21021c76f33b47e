"""Leased samples -> padded training tensors, and the model forward that scores response tokens.

Contract: a sample is an :class:`engine.records.Sample` (docs/CONTRACTS.md "Sample JSON"), its types checked
once where it was read (trainer.lease_client.typed_samples; one off the schema never gets here). What the
types cannot say is checked here: ``check_sample`` returns a reason string when a sample breaks the contract
(per-token lists of the wrong length, no response, unusable numbers); the loop then trains it with an all-zero
mask and logs the reason, so a bad sample is visible, acked and never crashes a step.
Sequences are prompt + response, right-padded to L; response position t of sample i is predicted by
the logits of row ``row[i]`` at ``P_i - 1 + t`` (``resp_index``), so all per-token tensors are (B, T)
response-aligned. Each sample has its own row, or with ``merge`` a session's token-continuous turns
share one (engine/trajectories.py: the row is the last turn's sequence, every earlier turn's response
sits inside it with its own exact prefix), so the shared prompt is run once and every per-token value
is the same as with separate rows.
Top-K teacher rows are used only for samples whose K equals the batch's most common K (others get
``topk_valid`` 0), because mixing K would double-count padded bins.
``constrained`` (CONTRACTS "Sample JSON") marks samples decoded under a grammar mask (forced tool calls):
their ``rollout_logprobs`` are the masked distribution's, so the loop never uses them as old log-probs
(``trainer.objective.select_old_logprobs``) nor in the train-vs-rollout gap; a missing flag means false.
``temperature`` (B,) is each sample's ``sampling_params.temperature`` (1.0 when absent; trainer/rollout_correction.py);
a temperature that is not a finite number >= 0 breaks the contract.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from engine.records import Sample
from engine.trajectories import plan_rows, row_sequence
from trainer.loss import entropy_from_logits, token_logprobs
from trainer.rollout_correction import check_sampling_params, sample_temperature


def check_sample(s: Sample, *, shaping: str = "none") -> str | None:
    """None if the sample is trainable, else why not (its types were checked where it was read).

    ``token_rewards`` must be null or one finite float per response id; with ``process_weighted``
    shaping they must lie in [0, 1] on loss-mask tokens (AReaL asserts this; here the sample is set aside
    instead of crashing the step).
    """
    resp = s.response_ids or []
    if not s.prompt_ids or not resp:
        return "empty prompt_ids or response_ids"
    n = len(resp)
    for key, values in (("rollout_logprobs", s.rollout_logprobs), ("loss_mask", s.loss_mask)):
        if len(values or []) != n:
            return f"{key} has {len(values or [])} entries for {n} response ids"
    if s.has_teacher and len(s.teacher_logprobs or []) != n:
        return f"has_teacher but teacher_logprobs has {len(s.teacher_logprobs or [])} entries for {n} response ids"
    if s.has_reward and s.reward is None:
        return "has_reward but reward is null"
    why = s.value_problem()  # the policy server checked the same before leasing; a sample file was not checked
    if why:
        return why
    tr = s.token_rewards
    if tr is not None:
        if len(tr) != n:
            return f"token_rewards has {len(tr)} entries for {n} response ids"
        if not all(math.isfinite(v) for v in tr):
            return "token_rewards holds a non-finite value"
        if shaping == "process_weighted" and any(
            m and not 0.0 <= v <= 1.0 for v, m in zip(tr, s.loss_mask, strict=True)
        ):
            return "process_weighted shaping needs token_rewards in [0, 1] on loss-mask tokens"
    if not all(math.isfinite(v) for v in s.rollout_logprobs or []):
        # A NaN/inf here would turn the rollout importance weight (and the gap metric) into NaN.
        return "rollout_logprobs holds a non-finite value"
    sp_err = check_sampling_params(s)
    if sp_err:
        return sp_err
    topk = s.teacher_topk
    if topk and (len(topk.ids) != n or len(topk.logprobs) != n):
        return "teacher_topk rows do not match response length"
    return None


@dataclass
class Batch:
    input_ids: torch.Tensor  # (G, L) long, pad 0: G rows, G <= B (merged turns share a row)
    attention_mask: torch.Tensor  # (G, L) long
    row: torch.Tensor  # (B,) long, the row holding sample i
    resp_index: torch.Tensor  # (B, T) long, logit position (in its row) predicting response token t
    response_ids: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T) float loss mask (0 on padding / excluded / invalid)
    rollout_lp: torch.Tensor  # (B, T)
    teacher_lp: torch.Tensor  # (B, T), 0 where missing
    has_teacher: torch.Tensor  # (B,) bool
    reward: torch.Tensor  # (B,), 0 where missing
    has_reward: torch.Tensor  # (B,) bool
    w_rl: torch.Tensor  # (B,)
    w_opd: torch.Tensor  # (B,)
    token_rewards: torch.Tensor  # (B, T), 0 where missing
    has_token_rewards: torch.Tensor  # (B,) bool
    topk_ids: torch.Tensor | None  # (B, T, K) long
    topk_lp: torch.Tensor | None  # (B, T, K)
    topk_valid: torch.Tensor  # (B, T) float
    constrained: torch.Tensor  # (B,) bool: rollout_lp come from a grammar-masked distribution
    temperature: torch.Tensor  # (B,) float: the engine's sampling temperature (1.0 when unknown)
    modes: list[str]

    def to(self, device: torch.device) -> Batch:
        for k, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                setattr(self, k, v.to(device))
        return self


def collate(
    samples: list[Sample],
    *,
    eos_id: int | None = None,
    mask_no_eos: bool = False,
    zero_mask: list[bool] | None = None,
    merge: bool = False,
) -> Batch:
    """Pad a list of samples; ``zero_mask[i]`` forces sample i's loss mask to 0 (invalid / dummy rows);
    ``merge`` lets a session's token-continuous turns share a row (never a zero-mask sample's)."""
    B = len(samples)
    zero_mask = zero_mask or [False] * B
    P = [len(s.prompt_ids or []) for s in samples]
    R = [len(s.response_ids or []) for s in samples]
    rows = plan_rows(samples, [not z for z in zero_mask]) if merge else [[i] for i in range(B)]
    row_of = [0] * B
    for g, members in enumerate(rows):
        for i in members:
            row_of[i] = g
    seqs = [row_sequence(samples, members) for members in rows]
    L, T = max(len(q) for q in seqs), max(R)
    ks = [len(s.teacher_topk.ids[0]) for s in samples if s.teacher_topk is not None and s.teacher_topk.ids]
    K = Counter(ks).most_common(1)[0][0] if ks else 0

    input_ids = torch.zeros(len(rows), L, dtype=torch.long)
    attn = torch.zeros(len(rows), L, dtype=torch.long)
    for g, q in enumerate(seqs):
        input_ids[g, : len(q)] = torch.tensor(q)
        attn[g, : len(q)] = 1
    resp_index = torch.zeros(B, T, dtype=torch.long)
    response_ids = torch.zeros(B, T, dtype=torch.long)
    f = lambda: torch.zeros(B, T)  # noqa: E731
    mask, rollout_lp, teacher_lp, token_rewards, topk_valid = f(), f(), f(), f(), f()
    topk_ids = torch.zeros(B, T, K, dtype=torch.long) if K else None
    topk_lp = torch.zeros(B, T, K) if K else None
    for i, s in enumerate(samples):
        p, r, resp = P[i], R[i], s.response_ids or []
        resp_index[i, :r] = torch.arange(p - 1, p - 1 + r)
        resp_index[i, r:] = p - 1  # padding reads a real position; masked anyway
        response_ids[i, :r] = torch.tensor(resp, dtype=torch.long)
        excluded = zero_mask[i] or (mask_no_eos and eos_id is not None and resp[-1] != eos_id)
        if not excluded:
            mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if zero_mask[i]:
            # A set-aside row keeps zeros: its values may be the very reason it was set aside, and a NaN
            # times a zero mask is still NaN in every sum it enters.
            continue
        rollout_lp[i, :r] = torch.tensor(s.rollout_logprobs or [], dtype=torch.float32)
        if s.has_teacher and s.teacher_logprobs:
            teacher_lp[i, :r] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
        if s.token_rewards is not None:
            token_rewards[i, :r] = torch.tensor(s.token_rewards, dtype=torch.float32)
        topk = s.teacher_topk
        if topk_ids is not None and topk_lp is not None and topk is not None and topk.ids and len(topk.ids[0]) == K:
            topk_ids[i, :r] = torch.tensor(topk.ids, dtype=torch.long)
            topk_lp[i, :r] = torch.tensor(topk.logprobs, dtype=torch.float32)
            topk_valid[i, :r] = mask[i, :r]
    live = [not z for z in zero_mask]

    def per_sample(values: list[float]) -> torch.Tensor:
        """(B,) of a number per sample, 0 on a set-aside row (its values may be why it was set aside)."""
        return torch.tensor([v if ok else 0.0 for v, ok in zip(values, live, strict=True)])

    def flags(values: list[bool]) -> torch.Tensor:
        """(B,) bool of a flag per sample, false on a set-aside row."""
        return torch.tensor([v and ok for v, ok in zip(values, live, strict=True)])

    return Batch(
        input_ids=input_ids,
        attention_mask=attn,
        row=torch.tensor(row_of, dtype=torch.long),
        resp_index=resp_index,
        response_ids=response_ids,
        mask=mask,
        rollout_lp=rollout_lp,
        teacher_lp=teacher_lp,
        has_teacher=flags([s.has_teacher and bool(s.teacher_logprobs) for s in samples]),
        reward=per_sample([0.0 if s.reward is None else s.reward for s in samples]),
        has_reward=flags([s.has_reward and s.reward is not None for s in samples]),
        w_rl=per_sample([s.w_rl for s in samples]),
        w_opd=per_sample([s.w_opd for s in samples]),
        token_rewards=token_rewards,
        has_token_rewards=flags([s.token_rewards is not None for s in samples]),
        topk_ids=topk_ids,
        topk_lp=topk_lp,
        topk_valid=topk_valid,
        constrained=flags([s.constrained for s in samples]),
        temperature=torch.tensor([sample_temperature(s) for s in samples], dtype=torch.float32),
        modes=[s.mode or "rl" for s in samples],
    )


@dataclass
class Scored:
    logprobs: torch.Tensor  # (B, T)
    logits: torch.Tensor  # (B, T, V) at response positions
    entropy: torch.Tensor | None  # (B, T)


def score_responses(model: torch.nn.Module, batch: Batch, *, with_entropy: bool) -> Scored:
    """Forward every row once; log-probs (and optionally entropy) of each sample's response tokens."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    full = out.logits  # (G, L, V)
    # Pick only the response positions before any softmax: the (G, L, V) log-softmax is never built.
    logits = full[batch.row[:, None], batch.resp_index].float()  # (B, T, V)
    lp = token_logprobs(logits, batch.response_ids)
    ent = entropy_from_logits(logits) if with_entropy else None
    return Scored(logprobs=lp, logits=logits, entropy=ent)


@dataclass
class Micro:
    """One collated micro-batch on this rank and the batch index of each row (-1: a zero-mask dummy row)."""

    batch: Batch
    sample_index: list[int]


@dataclass
class Minibatch:
    """One minibatch: its global loss denominators and this rank's micro-batches."""

    num_tokens: float
    num_seqs: float
    micros: list[Micro]
