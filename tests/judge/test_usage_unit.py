"""Unit tests of the judge's cost accounting on its one record type, engine.records.JudgeUsage.

Contract: each engine call adds one ``engine_calls``, its prompt tokens (the engine's count, else the
prompt's length) and its cached tokens; the request's ``usage`` is the sum over its tasks, every field
present (zeros included).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.records import JudgeUsage
from judge_server.judge import count_call, total_usage

pytestmark = pytest.mark.unit


def test_count_call_and_total() -> None:
    prm, hint = JudgeUsage(), JudgeUsage()
    count_call(prm, SimpleNamespace(prompt_tokens=40, meta_info={"cached_tokens": 32}), prompt_len=99)
    count_call(hint, SimpleNamespace(prompt_tokens=None, meta_info={}), prompt_len=12)
    hint.completion_tokens += 5
    total = total_usage([prm, hint])
    assert total.model_dump() == {"engine_calls": 2, "prompt_tokens": 52, "cached_tokens": 32, "completion_tokens": 5}


def test_total_of_nothing_has_every_field() -> None:
    assert total_usage([JudgeUsage()]).model_dump() == dict.fromkeys(
        ("engine_calls", "prompt_tokens", "cached_tokens", "completion_tokens"), 0
    )
