"""Value checks of a Sample's learning signals, shared by the policy server and the trainer.

Role: one definition of "a usable reward / teacher log-prob / token reward" for the Sample JSON
(``engine.records.Sample.value_problem`` runs it on a record), applied twice: by the policy
server before a sample becomes leasable (a failing sample is ``rejected`` with ``invalid_values: <why>``,
policy_server.store.samples) and by the trainer on every leased sample (trained with mask 0,
trainer.batch.check_sample). One NaN would otherwise turn the whole batch's advantages into NaN.

Contract of :func:`value_problem` (None = fine, else the reason):

- ``reward``: null, or a finite int/float (a bool is not a number here);
- ``teacher_logprobs``: null, or a list of finite numbers <= ``LOGPROB_TOLERANCE`` (a log-probability is
  never positive; the tolerance absorbs float rounding of a near-certain token);
- ``teacher_topk.logprobs``: when present, rows of finite numbers <= ``LOGPROB_TOLERANCE``;
- ``token_rewards``: null, or a list of finite numbers;
- ``rollout_logprobs``: when present and not null, finite numbers <= ``LOGPROB_TOLERANCE`` (a record
  without them is the trainer's structural check);
- ``w_rl`` / ``w_opd``: when present, finite numbers (null is refused: the loss would read it as a weight);
- ``teacher_temperature``: when present, exactly ``TEACHER_TEMPERATURE`` (1.0). The OPD term compares the
  teacher with the policy's T = 1 log-probs; a teacher scored at another temperature has a different
  target (docs/REWARD_MODES.md "Teacher temperature").

Lengths against ``response_ids`` are the trainer's structural check, not this one.
"""

from __future__ import annotations

import math
from typing import Any

LOGPROB_TOLERANCE = 1e-4
TEACHER_TEMPERATURE = 1.0  # the only temperature the OPD term's derivation holds at


def is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _logprob_problem(values: Any, what: str) -> str | None:
    if not isinstance(values, list):
        return f"{what} is not a list"
    for v in values:
        if not is_finite_number(v):
            return f"{what} holds a non-finite or non-numeric value ({v!r})"
        if v > LOGPROB_TOLERANCE:
            return f"{what} holds a positive log-probability ({v!r})"
    return None


def value_problem(sample: dict[str, Any]) -> str | None:
    """None when every learning signal of ``sample`` is usable, else the first problem found."""
    reward = sample.get("reward")
    if reward is not None and not is_finite_number(reward):
        return f"reward is not a finite number ({reward!r})"
    teacher = sample.get("teacher_logprobs")
    if teacher is not None:
        why = _logprob_problem(teacher, "teacher_logprobs")
        if why:
            return why
    topk = sample.get("teacher_topk")
    if isinstance(topk, dict) and topk.get("logprobs") is not None:
        rows = topk["logprobs"]
        if not isinstance(rows, list):
            return "teacher_topk.logprobs is not a list"
        for row in rows:
            why = _logprob_problem(row, "teacher_topk.logprobs")
            if why:
                return why
    tr = sample.get("token_rewards")
    if tr is not None:
        if not isinstance(tr, list):
            return "token_rewards is not a list"
        for v in tr:
            if not is_finite_number(v):
                return f"token_rewards holds a non-finite or non-numeric value ({v!r})"
    # The teacher_logprobs check above, for the other log-prob list (each names its own field).
    rollout = sample.get("rollout_logprobs")
    if rollout is not None:
        why = _logprob_problem(rollout, "rollout_logprobs")
        if why:
            return why
    for key in ("w_rl", "w_opd"):
        if key in sample and not is_finite_number(sample[key]):
            return f"{key} is not a finite number ({sample[key]!r})"
    if "teacher_temperature" in sample and sample["teacher_temperature"] != TEACHER_TEMPERATURE:
        return f"teacher_temperature must be {TEACHER_TEMPERATURE} ({sample['teacher_temperature']!r})"
    return None
