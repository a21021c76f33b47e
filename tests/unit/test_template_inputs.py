"""Real templates' demands on their inputs (engine.template_inputs through engine.chat's render), over the tiny tokenizer.

Contract: what a template refuses is a ``TemplateRefused`` quoting its complaint (the policy server's 400), never
another exception; where a template needs values in another form it gets that form: tool-call ``arguments`` as
a mapping (a template that iterates them), or as the string the client sent (a template that concatenates
them); Mistral's 9-alphanumeric tool-call ids, the same for a call and its result; a multi-template tokenizer
config renders ``tool_use`` when tools are present. Each case below is one a template used to turn into a 500.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from engine.chat import load_tokenizer, render_prompt_text
from engine.template_inputs import TemplateRefused, mistral_tool_call_id, template_messages
from policy_server.errors import install_error_handlers
from tests.testkit.chat_templates import TEMPLATES_DIR

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "rename", "parameters": {"type": "object", "properties": {}}}}]
CALL_ID = "call_0123456789abcdef01234567"  # the form this server issues
TOOL_LOOP = [
    {"role": "user", "content": "rename it"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": CALL_ID, "type": "function", "function": {"name": "rename", "arguments": '{"to": "b"}'}}],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": "done"},
]
# Seed-OSS's way with arguments: it iterates them as a mapping.
ITERATES_ARGUMENTS = (
    "{%- for m in messages %}{% for tc in m.tool_calls or [] %}"
    "{% for k, v in tc.function.arguments.items() %}<{{ k }}={{ v }}>{% endfor %}{% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _template(tokenizer: Any, name: str) -> Any:
    tokenizer.chat_template = (TEMPLATES_DIR / name).read_text()
    return tokenizer


def test_gemma2_refuses_a_system_message_in_its_own_words(tokenizer: Any) -> None:
    tok = _template(tokenizer, "google-gemma-2-2b-it.jinja")
    with pytest.raises(TemplateRefused, match="System role not supported"):
        render_prompt_text(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert render_prompt_text(tok, [{"role": "user", "content": "u"}]).endswith("<start_of_turn>model\n")


def test_mistral_nemo_tool_loop_gets_nine_alphanumeric_ids(tokenizer: Any) -> None:
    text = render_prompt_text(_template(tokenizer, "mistralai-Mistral-Nemo-Instruct-2407.jinja"), TOOL_LOOP, TOOLS)
    short = mistral_tool_call_id(CALL_ID)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", short) and short == "f01234567"
    assert f'"id": "{short}"' in text and f'"call_id": "{short}"' in text  # the call and its result still match
    assert re.fullmatch(r"[0-9a-f]{9}", mistral_tool_call_id("c_1"))  # too few alphanumerics: from its hash
    assert mistral_tool_call_id("abcDEF123") == "abcDEF123"


def test_a_template_that_iterates_arguments_gets_a_mapping(tokenizer: Any) -> None:
    tokenizer.chat_template = ITERATES_ARGUMENTS
    assert render_prompt_text(tokenizer, TOOL_LOOP, TOOLS, add_generation_prompt=False) == "<to=b>"
    # Not a JSON object: left as the client wrote it (the template's complaint about it is a refusal).
    broken = [TOOL_LOOP[0], {**TOOL_LOOP[1], "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(TemplateRefused):
        render_prompt_text(tokenizer, broken, TOOLS)


def test_a_template_that_concatenates_arguments_gets_the_string(tokenizer: Any) -> None:
    text = render_prompt_text(_template(tokenizer, "deepseek-ai-DeepSeek-V3.1.jinja"), TOOL_LOOP, TOOLS)
    assert 'rename<｜tool▁sep｜>{"to": "b"}<｜tool▁call▁end｜>' in text


def test_hermes3_tool_use_needs_tools_and_a_multi_template_config_picks_it(tokenizer: Any) -> None:
    tool_use = (TEMPLATES_DIR / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    tokenizer.chat_template = tool_use
    with pytest.raises(TemplateRefused, match="refused the conversation"):
        render_prompt_text(tokenizer, [{"role": "user", "content": "u"}])
    tokenizer.chat_template = {
        "default": (TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(),
        "tool_use": tool_use,
    }
    assert "You are a function calling AI model" in render_prompt_text(tokenizer, TOOL_LOOP, TOOLS)
    assert "You are Qwen" in render_prompt_text(tokenizer, [{"role": "user", "content": "u"}])


def test_template_messages_never_mutate_the_input() -> None:
    before = repr(TOOL_LOOP)
    out = template_messages(TOOL_LOOP, "mistral")
    assert repr(TOOL_LOOP) == before
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"to": "b"} and out[1]["content"] == ""


async def test_a_refusal_is_a_400_naming_the_complaint() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def answer() -> None:
        raise TemplateRefused("the model's chat template refused the conversation: System role not supported")

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "template_refused"
    assert "System role not supported" in err["message"]


def test_arguments_past_float_range_stay_as_written() -> None:
    call = {"id": "c", "function": {"name": "f", "arguments": '{"x": 1e999}'}}
    out = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1e999}'
