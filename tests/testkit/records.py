"""Small stored records for store-level tests (the shapes policy_server.store writes and reads)."""

from __future__ import annotations

from typing import Any

USER_HI = {"role": "user", "content": "hi"}


def turn_record() -> dict[str, Any]:
    """A two-token main turn answering ``USER_HI`` (a TurnRecord JSON as ``Store.record_turn`` takes it)."""
    return {
        "messages": [USER_HI],
        "tools": None,
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "rollout_logprobs": [-0.1, -0.2],
        "response": {"content": "x"},
        "weight_version": "v0",
        "weight_versions": ["v0"],
        "sampling_params": {},
    }
