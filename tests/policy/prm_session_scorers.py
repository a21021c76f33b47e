"""Test scorers loaded by the policy-server PROCESS from ``--prm-config`` (dotted path
``tests.policy.prm_session_scorers.TrajectoryProbe``; the tests put the repository root on that process's
PYTHONPATH).

``TrajectoryProbe`` is a real ``BaseTrajectoryScorer``. Each call appends one JSON line to ``record_path``
describing exactly what the runner handed it (turn order, parent links, next states, sample statuses, the
context's message count), so a test in another process can check what the scorer saw. Its reward for a
turn is ``10 * len(trajectory) + turn_index``: it depends on the whole trajectory, so a rewarded sample
shows both which turn it is and how long the scored trajectory was.

- ``None`` (a rejection) when a next state contains ``reject_marker``;
- ``JudgeUnavailable`` (a dependency that cannot be reached: not a verdict) while ``unavailable_flag``
  names an existing file, so a test can switch the dependency off and on from outside.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from judge_server.errors import JudgeUnavailable
from prm import BaseTrajectoryScorer


class TrajectoryProbe(BaseTrajectoryScorer):
    name = "trajectory_probe"

    def __init__(
        self,
        record_path: str,
        reject_marker: str = "REJECT-ME",
        unavailable_flag: str | None = None,
        weight: float = 1.0,
        enabled: bool = True,
    ):
        super().__init__(weight=weight, enabled=enabled)
        self.record_path = record_path
        self.reject_marker = reject_marker
        self.unavailable_flag = unavailable_flag

    async def evaluate_trajectory(self, interactions: Sequence[Any], ctx: Mapping[str, Any]) -> dict[str, float] | None:
        if self.unavailable_flag and os.path.exists(self.unavailable_flag):
            raise JudgeUnavailable(f"probe dependency is down ({self.unavailable_flag} exists)")
        seen = {
            "session_id": ctx["session_id"],
            "ctx_messages": len(ctx["messages"]),
            "turns": [
                {
                    "turn_index": it.turn_index,
                    "interaction_id": it.interaction_id,
                    "parent_id": it.parent_id,
                    "next_state": [m.get("content") for m in it.next_state],
                    "sample_status": it.extra.get("sample_status"),
                    "reject_reason": it.extra.get("reject_reason"),
                    "output_len": it.output_len,
                }
                for it in interactions
            ],
        }
        with open(self.record_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(seen) + "\n")
        if any(self.reject_marker in str(m.get("content")) for it in interactions for m in it.next_state):
            return None
        n = len(interactions)
        return {it.interaction_id: float(10 * n + it.turn_index) for it in interactions}
