"""Which model family a chat template belongs to: its tool-call and reasoning parsers and its tool-call ids.

Role: read once from the template's source (``detect_family``), by the markup the template itself writes;
the names are SGLang's ``--tool-call-parser`` / ``--reasoning-parser`` names, so an operator's flag and the
detected value mean the same. Contract: a template whose markup matches no family gets the Hermes/Qwen
parsers (``qwen25``), the markup the tiny models and most open models use; ``id_form`` is ``"mistral"``
where the template demands 9-alphanumeric tool-call ids, else ``"openai"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("qwen25", "hermes", "llama3", "mistral", "deepseekv3", "deepseekv31", "kimi_k2", "gpt-oss")
REASONING_PARSERS = ("qwen3", "deepseek-r1", "gpt-oss")


@dataclass(frozen=True)
class ChatFamily:
    """A template's family: how its replies are parsed, and the tool-call id form its history needs."""

    tool_call_parser: str
    reasoning_parser: str | None
    id_form: str = "openai"


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


def detect_family(source: str) -> ChatFamily:
    """The family whose markup the template source writes (see the module docstring)."""
    for marker, family in _MARKERS:
        if marker in source:
            if family.tool_call_parser == "qwen25" and "<think>" not in source:
                return ChatFamily("qwen25", None)
            return family
    return DEFAULT_FAMILY


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
    return ChatFamily(tool, reasoning, id_form)
