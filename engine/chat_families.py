"""Which model family a chat template belongs to: its tool-call and reasoning parsers, its tool-call ids and the
template variable that switches its reasoning.

Role: read once from the template's source (``detect_family``), by the markup the template itself writes;
the names are SGLang's ``--tool-call-parser`` / ``--reasoning-parser`` names, so an operator's flag and the
detected value mean the same. Contract: a template whose markup matches no family gets the Hermes/Qwen
parsers (``qwen25``), the markup the tiny models and most open models use; ``id_form`` is ``"mistral"``
where the template demands 9-alphanumeric tool-call ids, else ``"openai"``.

``reasoning_switch`` is the variable the template reads to switch its reasoning, and
:func:`reasoning_template_kwargs` maps OpenAI's ``reasoning_effort`` onto it:

- ``enable_thinking`` (Qwen3, QwQ-style): ``none``/``minimal`` -> ``False`` (the generation prompt opens an empty
  think block), ``low`` and above -> ``True`` (the template's default);
- ``thinking`` (DeepSeek-V3.1, whose default is off): ``none``/``minimal`` -> ``False``, ``low`` and above ->
  ``True`` (the generation prompt opens ``<think>``);
- ``reasoning_effort`` (gpt-oss, levels ``low``/``medium``/``high`` in its system message, default ``medium``):
  the level as is, ``xhigh`` -> ``high``, and ``none``/``minimal`` -> ``low``: the harmony format has no
  reasoning-off switch, its least reasoning is ``low``;
- none (Qwen2.5, Llama 3.1, Hermes, Mistral, Gemma, Kimi-K2, the DeepSeek-R1 distills): the field changes
  nothing, as the template has nothing to switch (an R1 distill always reasons).

No ``reasoning_effort`` leaves the template's own default (no argument at all).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("qwen25", "hermes", "llama3", "mistral", "deepseekv3", "deepseekv31", "kimi_k2", "gpt-oss")
REASONING_PARSERS = ("qwen3", "deepseek-r1", "gpt-oss")
REASONING_SWITCHES = ("enable_thinking", "thinking", "reasoning_effort")
REASONING_OFF_EFFORTS = ("none", "minimal")


@dataclass(frozen=True)
class ChatFamily:
    """A template's family: how its replies are parsed, the tool-call id form its history needs, and the variable
    that switches its reasoning (one of :data:`REASONING_SWITCHES`, or None)."""

    tool_call_parser: str
    reasoning_parser: str | None
    id_form: str = "openai"
    reasoning_switch: str | None = None

    def keeps_special_tokens(self, tools_active: bool) -> bool:
        """Whether the engine must keep special tokens in the reply's text (``skip_special_tokens: false``), as
        SGLang's own chat server decides: with tools offered (a family's call markup may be special tokens, e.g.
        Mistral's ``[TOOL_CALLS]``, which the default decoding drops, and the call would be lost), and always for
        gpt-oss (its channels are special tokens). The token ids are the same either way; only the text differs."""
        return tools_active or self.reasoning_parser == "gpt-oss"


# (markup the template writes, family); the first match wins, the most specific markup first.
_MARKERS: tuple[tuple[str, ChatFamily], ...] = (
    ("<|channel|>", ChatFamily("gpt-oss", "gpt-oss")),
    ("[TOOL_CALLS]", ChatFamily("mistral", None, id_form="mistral")),
    ("<|tool_calls_section_begin|>", ChatFamily("kimi_k2", None)),
    ("'```json'", ChatFamily("deepseekv3", "deepseek-r1")),  # V3 and the R1 distills: fenced arguments
    ("<｜tool▁calls▁begin｜>", ChatFamily("deepseekv31", "deepseek-r1")),
    ("<tool_call>", ChatFamily("qwen25", "qwen3")),
    ("<|python_tag|>", ChatFamily("llama3", None)),
    ('"parameters": ', ChatFamily("llama3", None)),
)
DEFAULT_FAMILY = ChatFamily("qwen25", "qwen3")


def template_source(tokenizer: Any) -> str:
    """The tokenizer's chat template text; a multi-template config's templates joined (any of them counts)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return "\n".join(str(v) for v in tpl.values())
    if isinstance(tpl, list):  # the tokenizer_config.json form: [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in tpl if isinstance(t, dict))
    return str(tpl or "")


# A bare ``thinking`` variable (DeepSeek-V3.1's ``thinking is defined``), not a message's field (``message.thinking``,
# ``"thinking" in message``) nor part of a longer name (``enable_thinking``).
_BARE_THINKING = re.compile(r"(?<![\w.'\"])thinking\b(?!['\"])")


def detect_reasoning_switch(source: str) -> str | None:
    """The variable the template source reads to switch its reasoning (the module docstring), or None."""
    if re.search(r"\breasoning_effort\b", source):
        return "reasoning_effort"
    if re.search(r"\benable_thinking\b", source):
        return "enable_thinking"
    if _BARE_THINKING.search(source):
        return "thinking"
    return None


def detect_family(source: str) -> ChatFamily:
    """The family whose markup the template source writes (see the module docstring)."""
    family = DEFAULT_FAMILY
    for marker, candidate in _MARKERS:
        if marker in source:
            no_think = candidate.tool_call_parser == "qwen25" and "<think>" not in source
            family = ChatFamily("qwen25", None) if no_think else candidate
            break
    return dataclasses.replace(family, reasoning_switch=detect_reasoning_switch(source))


def reasoning_template_kwargs(switch: str | None, effort: str | None) -> dict[str, Any] | None:
    """The template arguments that give ``reasoning_effort`` ``effort`` through the template's ``switch`` (the
    module docstring); None when there is nothing to pass."""
    if effort is None or switch is None:
        return None
    off = effort in REASONING_OFF_EFFORTS
    if switch == "reasoning_effort":
        return {switch: "low" if off else "high" if effort == "xhigh" else effort}
    return {switch: not off}


def resolve_family(
    tokenizer: Any, tool_call_parser: str | None = None, reasoning_parser: str | None = None
) -> ChatFamily:
    """The family detected from the tokenizer's template, with an operator's explicit parser names over it
    (``reasoning_parser="none"``: no reasoning split). Mistral's id form follows its parser, set or detected."""
    detected = detect_family(template_source(tokenizer))
    tool = tool_call_parser or detected.tool_call_parser
    if reasoning_parser is None:
        reasoning = detected.reasoning_parser
    else:
        reasoning = None if reasoning_parser == "none" else reasoning_parser
    id_form = "mistral" if tool == "mistral" else detected.id_form
    return ChatFamily(tool, reasoning, id_form, detected.reasoning_switch)
