"""The training data of the tool-calling tiny policy (engine.tiny_tool_model) follows its documented rule.

The rule: a tool call exactly when the prompt holds the trigger word and no tool result; otherwise text. These
tests check the examples, their gapped positions and the dilution mask, not the trained model (the OpenClaw e2e
test checks that on real prompts).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from engine import tiny_tool_model as ttm
from engine.model_cache import tiny_policy

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.chat import load_tokenizer

    return load_tokenizer(str(tiny_policy(seed=0)))


def test_trigger_word_is_one_token(tokenizer: Any) -> None:
    assert len(tokenizer.encode(ttm.TRIGGER_WORD, add_special_tokens=False)) == 1


def test_examples_follow_the_rule(tokenizer: Any) -> None:
    rng = random.Random(7)
    trigger = tokenizer.encode(ttm.TRIGGER_WORD, add_special_tokens=False)[0]
    result = tokenizer.convert_tokens_to_ids("<tool_response>")
    seen = set()
    for _ in range(300):
        messages, tools, target = ttm.training_example(rng)
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text.replace(ttm._FILLER_SLOT, ""), add_special_tokens=False)
        wants_call = trigger in ids and result not in ids
        assert target.startswith("<tool_call>") == wants_call, (text, target)
        if wants_call:
            assert json.loads(target.removeprefix("<tool_call>").removesuffix("</tool_call>")) == ttm.TOOL_CALL
        else:
            assert target == ttm.TEXT_ANSWER
        assert any(t["function"]["name"] == ttm.TOOL_CALL["name"] for t in tools)
        seen.add(target[:5])
    assert len(seen) == 2  # both answers occur


def test_sequences_have_gapped_increasing_positions_and_clean_filler(tokenizer: Any) -> None:
    rng = random.Random(3)
    banned = {tokenizer.encode(ttm.TRIGGER_WORD, add_special_tokens=False)[0], *tokenizer.all_special_ids}
    far = 0
    for _ in range(50):
        ids, positions, plen, (f0, f1) = ttm._sequence(rng, tokenizer, banned, 128)
        assert len(ids) == len(positions) and 0 < plen < len(ids)
        assert all(b > a for a, b in zip(positions, positions[1:], strict=False))
        assert positions[-1] < ttm.POSITION_SPAN
        assert not banned & set(ids[f0:f1])
        assert ids[-1] == tokenizer.eos_token_id
        far = max(far, positions[-1])
    assert far > 16 * 1024  # the tail lands far out, as at the end of a long prompt


def test_attention_bias_is_causal_and_weighs_filler() -> None:
    bias = ttm._attention_bias(6, (1, 3), 10.0)
    assert bias.shape == (6, 6)
    assert math.isinf(bias[0, 1]) and bias[0, 0] == 0
    assert bias[5, 1] == pytest.approx(math.log(10.0)) and bias[5, 4] == 0
