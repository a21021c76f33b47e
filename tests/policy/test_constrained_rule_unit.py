"""Unit tests of the one rule for "was this turn constrained?" (engine.tool_grammar.is_constrained).

Contract: a turn is constrained when its SGLang sampling params set any grammar key (``regex``,
``json_schema``, ``ebnf``; a key present with null sets nothing). The turn record's ``constrained`` flag is
computed by that rule when the turn is recorded (policy_server.serving.chat_turn.turn_record), and the judge
dispatch reads the flag, or applies the same rule to the sampling params of a turn recorded without it.
"""

from __future__ import annotations

import pytest

from engine.records import TurnRecord
from engine.tool_grammar import GRAMMAR_KEYS, is_constrained
from policy_server.rewards.dispatch import is_constrained as turn_is_constrained
from policy_server.serving.chat_turn import turn_record
from policy_server.serving.generation import GenResult

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("key", GRAMMAR_KEYS)
def test_any_grammar_key_constrains(key: str) -> None:
    assert is_constrained({"max_new_tokens": 8, key: 'root ::= "x"'})


@pytest.mark.parametrize("sp", [{}, {"max_new_tokens": 8, "temperature": 1.0}, {"ebnf": None, "regex": None}])
def test_no_grammar_is_free_sampling(sp: dict[str, object]) -> None:
    assert not is_constrained(sp)


def _record(sp: dict[str, object]) -> dict[str, object]:
    res = GenResult(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5], weight_versions=["0"])
    return turn_record([{"role": "user", "content": "hi"}], None, res, {"content": "x"}, sp, None)


@pytest.mark.parametrize(
    ("sp", "expected"),
    [({"max_new_tokens": 8}, False), ({"max_new_tokens": 8, "ebnf": 'root ::= "x"'}, True)],
)
def test_recorded_flag_and_dispatch_agree(sp: dict[str, object], expected: bool) -> None:
    record = _record(sp)
    assert record.constrained is expected and record.to_json()["constrained"] is expected
    assert turn_is_constrained(record) is expected
    # A turn recorded before the flag existed: the flag absent from its JSON, so read as false.
    legacy = TurnRecord.model_validate({k: v for k, v in record.to_json().items() if k != "constrained"})
    assert turn_is_constrained(legacy) is expected
