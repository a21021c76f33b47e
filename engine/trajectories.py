"""Merged session trajectories: a session's token-continuous turns as one sequence, the prompt run once.

Role: the one rule, shared by the lease API (``merge=true``) and the trainer (``--merge-trajectories``), for
which samples can share a forward pass. Pure.

Rule. Samples of the same ``session_id``, taken in ``turn_index`` order, share a row while each one's
``prompt_ids + response_ids`` starts with the previous member's (the policy server's token-continuous
turns do: a continuing turn's prompt is the previous prompt, the sampled reply, then the new messages).
The row is the last member's sequence; member i's response sits at ``[len(prompt_ids_i),
len(prompt_ids_i) + len(response_ids_i))`` of it, and every position before it holds exactly member i's
own prefix, so under causal attention each response token sees the same context as in its own sequence:
per-token log-probs, losses and gradients are those of separate samples, up to float rounding. Samples
without a session, turns that do not continue (a full render after a template rewrite, a history
mismatch) and samples marked ineligible each get their own row. Nothing about the per-turn fields merges:
rewards, teacher log-probs (OPD/combine score each turn on its own hint-augmented prompt), loss masks and
advantages stay per sample and per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.records import MergedTrajectory, MergedTurn, Sample


def _seq(s: Sample) -> list[int] | None:
    p, r = s.prompt_ids, s.response_ids
    if not p or not r:
        return None
    return [*p, *r]


def plan_rows(samples: Sequence[Sample], eligible: Sequence[bool] | None = None) -> list[list[int]]:
    """Rows of sample indices (see the module rule); every sample is in exactly one row, rows in first-member
    order, members in turn order. The row's sequence is its last member's prompt + response."""
    eligible = eligible if eligible is not None else [True] * len(samples)
    seqs = [_seq(s) if ok else None for s, ok in zip(samples, eligible, strict=True)]
    by_session: dict[str, list[int]] = {}
    rows: list[list[int]] = []
    for i, s in enumerate(samples):
        if seqs[i] is None or s.session_id is None or s.turn_index is None:
            rows.append([i])
        else:
            by_session.setdefault(s.session_id, []).append(i)
    for members in by_session.values():
        members.sort(key=lambda i: samples[i].turn_index or 0)
        cur: list[int] = []
        tail: list[int] | None = None
        for i in members:
            seq = seqs[i]
            assert seq is not None
            if tail is not None and len(seq) >= len(tail) and seq[: len(tail)] == tail:
                cur.append(i)
            else:
                cur = [i]
                rows.append(cur)
            tail = seq
    rows.sort(key=min)
    return rows


def row_sequence(samples: Sequence[Sample], row: list[int]) -> list[int]:
    """The token ids a row runs: its last member's prompt + response (none for a sample without them)."""
    last = samples[row[-1]]
    return [*(last.prompt_ids or []), *(last.response_ids or [])]


def forward_tokens(samples: Sequence[Sample], rows: list[list[int]]) -> int:
    """Tokens a forward pass runs for these rows (what the trainer pays)."""
    return sum(len(row_sequence(samples, r)) for r in rows)


def merged_trajectories(samples: Sequence[Sample]) -> list[MergedTrajectory]:
    """The lease API's ``trajectories``: one entry per row of two or more samples (``token_ids`` once, each
    member's response offset)."""
    out = []
    for row in plan_rows(samples):
        if len(row) < 2:
            continue
        members = [samples[i] for i in row]
        out.append(
            MergedTrajectory(
                session_id=members[0].session_id or "",
                token_ids=row_sequence(samples, row),
                turns=[
                    MergedTurn(
                        sample_id=m.sample_id,
                        turn_index=m.turn_index or 0,
                        response_start=len(m.prompt_ids or []),
                        response_len=len(m.response_ids or []),
                    )
                    for m in members
                ],
            )
        )
    return out
