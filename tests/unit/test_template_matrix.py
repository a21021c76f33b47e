"""Every shared real chat template (tests/data/chat-templates) over the tiny tokenizer, in both history modes.

Contract (engine.continuation): with ``history="sampled"`` each continued turn's prompt ids start with the
previous turn's prompt ids + its sampled ids, for 4 of 4 continued turns of plain chat, ``reasoning_effort``
``none`` and ``high`` (each through the template's own switch: engine.chat_families) and a forced tool loop,
whatever the template does to its history; what follows them is the template's own
rendering of the new messages (a suffix of its full render of the conversation). With
``history="template"`` the prompt is exactly the template's full render. Sampled replies are stand-ins
(text + the stop token), as the engine would return them: continuity does not depend on their content.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from engine.chat import load_tokenizer, render_prompt_ids, render_prompt_text
from engine.chat_families import detect_family, reasoning_template_kwargs
from engine.continuation import CONTINUED, CONTINUED_OVER_REWRITE, ContinuationRenderer, PriorTurn
from tests.testkit.chat_templates import TEMPLATES_DIR

TEMPLATES = sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja"))
SCENARIOS = ("plain", "thinking_off", "thinking_high", "tool_loop")
EFFORTS = {"thinking_off": "none", "thinking_high": "high"}  # the scenario's reasoning_effort
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "rename",
            "description": "rename the file",
            "parameters": {"type": "object", "properties": {"to": {"type": "string"}}},
        },
    }
]
NO_SYSTEM = {"google-gemma-2-2b-it.jinja"}  # its template refuses a system message (tested on its own)
TOOL_USE_ONLY = {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"}  # cannot render without tools
NO_TOOL_ROLE = {("google-gemma-2-2b-it.jinja", "tool_loop")}  # Gemma 2 has no tool role: refused (tested on its own)
TURNS = 5  # one opening turn, then 4 continued ones


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _with_template(tokenizer: Any, name: str) -> Any:
    tok = tokenizer  # the module's one tokenizer: each test sets the template it renders with
    tok.chat_template = (TEMPLATES_DIR / name).read_text()
    return tok


def _sampled(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def _session(tokenizer: Any, name: str, scenario: str, history: str) -> list[tuple[Any, list[int], list[int], str]]:
    """Runs the scenario; per continued turn: (rendered, previous prompt ids, previous sampled ids, full text)."""
    renderer = ContinuationRenderer(tokenizer, verify_tokens_per_turn=10**9, history=history)
    tools = TOOLS if scenario == "tool_loop" or name in TOOL_USE_ONLY else None
    switch = detect_family(tokenizer.chat_template).reasoning_switch
    kwargs = reasoning_template_kwargs(switch, EFFORTS.get(scenario))
    messages: list[dict[str, Any]] = [] if name in NO_SYSTEM else [{"role": "system", "content": "You manage files."}]
    messages.append({"role": "user", "content": "list the report folder"})
    prior: PriorTurn | None = None
    out = []
    for k in range(TURNS):
        rendered = renderer.render(messages, tools, kwargs, prior)
        if prior is not None:
            full = render_prompt_text(tokenizer, messages, tools, chat_template_kwargs=kwargs)
            out.append((rendered, prior.prompt_ids, prior.response_ids, full))
        if scenario == "tool_loop":
            call_id = f"call_{k:024x}"
            args = f'{{"to": "r{k}"}}'
            response = _sampled(tokenizer, f'<tool_call>\n{{"name": "rename", "arguments": {args}}}\n</tool_call>')
            reply = {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "rename", "arguments": args}}],
            }
            new = [{"role": "tool", "tool_call_id": call_id, "content": f"renamed to r{k}"}]
        else:
            # A reply after a prompt that opened the think block (DeepSeek-V3.1 thinking) closes it; others open it.
            opened = tokenizer.decode(rendered.ids[-2:]).endswith("<think>")
            thought = "" if scenario == "thinking_off" else f"{'' if opened else '<think>'}\nstep {k}\n</think>\n\n"
            response = _sampled(tokenizer, f"{thought}answer {k}")
            reply = {"role": "assistant", "content": f"answer {k}"}
            if thought:
                reply["reasoning_content"] = f"step {k}"
            new = [{"role": "user", "content": f"next request {k}"}]
        prior = PriorTurn(list(messages), tools, kwargs, rendered.ids, response)
        messages = [*messages, reply, *new]
    return out


CASES = [(t, s) for t, s in itertools.product(TEMPLATES, SCENARIOS) if (t, s) not in NO_TOOL_ROLE]


@pytest.mark.parametrize(("name", "scenario"), CASES)
def test_sampled_history_continues_every_turn(tokenizer: Any, name: str, scenario: str) -> None:
    tok = _with_template(tokenizer, name)
    turns = _session(tok, name, scenario, "sampled")
    assert len(turns) == TURNS - 1
    for rendered, prompt_ids, response_ids, full in turns:
        kept = prompt_ids + response_ids
        assert rendered.reason in (CONTINUED, CONTINUED_OVER_REWRITE) and rendered.verified  # checked, passed
        assert rendered.ids[: len(kept)] == kept and rendered.reused_tokens == len(kept)
        added = tok.decode(rendered.ids[len(kept) :], skip_special_tokens=False)
        # The new messages in the template's own words: what its full render ends with.
        assert added and full.endswith(added), (added, full[-300:])


@pytest.mark.parametrize(("name", "scenario"), CASES)
def test_template_history_is_the_full_render(tokenizer: Any, name: str, scenario: str) -> None:
    tok = _with_template(tokenizer, name)
    for rendered, _, _, full in _session(tok, name, scenario, "template"):
        assert rendered.reason == "history_template"
        assert rendered.ids == list(tok.encode(full, add_special_tokens=False))


def test_qwen3_thinking_off_keeps_the_empty_think_block_of_the_previous_prompt(tokenizer: Any) -> None:
    tok = _with_template(tokenizer, "Qwen-Qwen3-0.6B.jinja")
    rendered, prompt_ids, _, full = _session(tok, "Qwen-Qwen3-0.6B.jinja", "thinking_off", "sampled")[0]
    assert tok.decode(prompt_ids).endswith("<think>\n\n</think>\n\n")  # what the reply was sampled after
    assert tok.decode(rendered.ids).count("<think>\n\n</think>") == 2  # still there, and the new one
    assert full.count("<think>\n\n</think>") == 1  # the template's own render drops the earlier one


def test_render_ids_match_text(tokenizer: Any) -> None:
    tok = _with_template(tokenizer, "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.decode(render_prompt_ids(tok, msgs)) == render_prompt_text(tok, msgs)
