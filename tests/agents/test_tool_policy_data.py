"""The training data of the tool-calling tiny policy (devkit.tiny_tool_model) follows its documented rule.

The rule: a tool call exactly when the request tail holds the trigger word and no tool result; otherwise text.
These tests check the examples, the fixed-length tails cut from them, and that a windowed Qwen3 depends only on
its receptive field; not the trained model (the OpenClaw e2e test checks that on real prompts).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from devkit import tiny_tool_model as ttm
from devkit.model_cache import tiny_policy
from engine.chat import render_prompt_text

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
        text = render_prompt_text(tokenizer, messages, tools)  # the builder's render (None content as "")
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


def test_sequences_are_fixed_length_tails_that_keep_what_decides(tokenizer: Any) -> None:
    rng = random.Random(3)
    trigger = tokenizer.encode(ttm.TRIGGER_WORD, add_special_tokens=False)[0]
    result = tokenizer.convert_tokens_to_ids("<tool_response>")
    banned = {trigger, result, *tokenizer.all_special_ids}
    calls = 0
    for i in range(60):
        short = i % 3 == 0
        prompt, answer = ttm._sequence(
            rng, tokenizer, banned, ttm.SHORT_PROMPT_TOKENS if short else ttm.TRAIN_PROMPT_TOKENS
        )
        assert len(prompt) >= ttm.SHORT_PROMPT_TOKENS if short else len(prompt) == ttm.TRAIN_PROMPT_TOKENS
        assert answer[-1] == tokenizer.eos_token_id
        is_call = answer[: len(answer) - 1] != tokenizer.encode(ttm.TEXT_ANSWER, add_special_tokens=False)
        # the cut keeps the request tail: the rule holds on the kept tokens alone
        assert is_call == (trigger in prompt and result not in prompt)
        calls += is_call
    assert 0 < calls < 60


def test_windowed_model_sees_only_its_receptive_field() -> None:
    """The premise of the tool policy: with every layer windowed, the last logits of a long sequence equal those
    of its last ``layers * (window - 1)`` tokens alone, at any absolute position."""
    import torch

    from tests.testkit.models import windowed_qwen3

    window, layers = 32, 2
    model = windowed_qwen3(window, layers=layers)
    ids = torch.randint(0, 97, (1, 700))
    field = layers * (window - 1)
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, -1]
        tail = model(input_ids=ids[:, -field - 1 :]).logits[0, -1]
        short = model(input_ids=ids[:, -field // 4 :]).logits[0, -1]
    assert torch.allclose(full, tail, atol=1e-4)
    assert not torch.allclose(full, short, atol=1e-4)  # a tail shorter than the field does change the output
