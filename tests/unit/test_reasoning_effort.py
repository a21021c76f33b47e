"""engine.chat_families: ``reasoning_effort`` reaches each shared real template through the variable that template
switches its reasoning with, and the rendered prompt shows it.

Contract (the module docstring): Qwen3's ``enable_thinking`` and DeepSeek-V3.1's ``thinking`` are off for
``none``/``minimal`` and on for the other levels; gpt-oss's ``reasoning_effort`` takes the level (``xhigh`` ->
``high``, ``none``/``minimal`` -> ``low``); the templates without a switch render the same for every value. What
each template writes is read from its own render over the tiny tokenizer: the markup at the end of the generation
prompt, or gpt-oss's ``Reasoning:`` line. Continuity with these arguments is tests/unit/test_template_matrix.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.chat import load_tokenizer, render_prompt_text
from engine.chat_families import detect_family, reasoning_template_kwargs
from tests.testkit.chat_templates import TEMPLATES_DIR

pytestmark = pytest.mark.unit

EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")
SWITCHES = {
    "Qwen-Qwen3-0.6B.jinja": "enable_thinking",
    "deepseek-ai-DeepSeek-V3.1.jinja": "thinking",
    "openai-gpt-oss-120b.jinja": "reasoning_effort",
}
TEMPLATES = sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja"))
MESSAGES = [{"role": "user", "content": "list the report folder"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _render(tokenizer: Any, name: str, effort: str | None) -> str:
    tokenizer.chat_template = source = (TEMPLATES_DIR / name).read_text()
    kwargs = reasoning_template_kwargs(detect_family(source).reasoning_switch, effort)
    messages = MESSAGES if "gemma" in name else [{"role": "system", "content": "You manage files."}, *MESSAGES]
    tools = [{"type": "function", "function": {"name": "rename"}}] if "tool_use" in name else None
    return render_prompt_text(tokenizer, messages, tools, chat_template_kwargs=kwargs)


@pytest.mark.parametrize("name", TEMPLATES)
def test_switch_is_detected_from_the_template(name: str) -> None:
    assert detect_family((TEMPLATES_DIR / name).read_text()).reasoning_switch == SWITCHES.get(name)


def test_effort_maps_onto_each_switch() -> None:
    for switch in ("enable_thinking", "thinking"):
        assert [reasoning_template_kwargs(switch, e) for e in EFFORTS] == [
            None,
            *({switch: False} for _ in range(2)),
            *({switch: True} for _ in range(4)),
        ]
    levels = [reasoning_template_kwargs("reasoning_effort", e) for e in EFFORTS]
    assert levels == [None, *({"reasoning_effort": lv} for lv in ("low", "low", "low", "medium", "high", "high"))]
    assert {str(reasoning_template_kwargs(None, e)) for e in EFFORTS} == {"None"}


def test_qwen3_none_opens_an_empty_think_block(tokenizer: Any) -> None:
    for effort in EFFORTS:
        text = _render(tokenizer, "Qwen-Qwen3-0.6B.jinja", effort)
        off = effort in ("none", "minimal")
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == off, effort
        assert text.endswith("<|im_start|>assistant\n") != off, effort  # thinking on: the model opens its own


def test_deepseek_v31_levels_turn_thinking_on(tokenizer: Any) -> None:
    for effort in EFFORTS:
        text = _render(tokenizer, "deepseek-ai-DeepSeek-V3.1.jinja", effort)
        on = effort not in (None, "none", "minimal")  # the template's default is off
        assert text.endswith("<｜Assistant｜><think>" if on else "<｜Assistant｜></think>"), effort


def test_gpt_oss_takes_the_level_and_none_is_its_lowest(tokenizer: Any) -> None:
    expected = {None: "medium", "none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}
    expected["xhigh"] = "high"
    for effort in EFFORTS:
        text = _render(tokenizer, "openai-gpt-oss-120b.jinja", effort)
        assert text.count("Reasoning: ") == 1 and f"Reasoning: {expected[effort]}\n" in text, effort


@pytest.mark.parametrize("name", [n for n in TEMPLATES if n not in SWITCHES])
def test_templates_without_a_switch_render_the_same_for_every_effort(tokenizer: Any, name: str) -> None:
    assert len({_render(tokenizer, name, effort) for effort in EFFORTS}) == 1
