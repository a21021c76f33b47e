"""Chat rendering and assistant-output parsing shared by the dev engine and the policy server.

Rendering: ``render_prompt_ids`` applies the model's own chat template (``tokenize=False``) and
encodes the string without adding special tokens, so the ids are exactly what the template says.

Parsing: ``parse_assistant_output`` splits sampled text into ``reasoning_content`` (a leading
``<think>…</think>`` block, or the text before the first ``</think>`` when the prompt opened the block),
``content`` and ``tool_calls`` (Qwen/Hermes ``<tool_call>{json}</tool_call>``
blocks). A call is read by its structure, not by a pattern over the text: the JSON object after
``<tool_call>`` is decoded where it stands, so it ends where its own braces close, and only then must the
closing tag follow. A ``</tool_call>`` inside one of its strings is data, never the end of the call.
Parsers sit behind two tiny interfaces so other model families can add theirs.
The parse never changes the sampled token ids; it only decides how the text is shown to the client.
"""

from __future__ import annotations

import functools
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.chat_families import ChatFamily, detect_family, template_source
from engine.template_inputs import TEMPLATE_FAILURES, refusal, template_messages, template_tools


@dataclass
class ParsedOutput:
    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ReasoningParser(Protocol):
    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]: ...


class ToolCallParser(Protocol):
    open_tag: str  # where a call starts in the family's markup (a stream holds the text from there)

    def extract(self, text: str) -> tuple[str, list[dict[str, Any]]]: ...


class ThinkReasoningParser:
    """``<think>reasoning</think>answer``; an unclosed block (cut by max_tokens) is all reasoning.

    Whether the reply starts inside a block is the prompt's to say, never a guess from the reply (SGLang's
    ``force_reasoning``): ``opened`` (the rendered prompt ends with ``<think>``, :func:`prompt_opens_think`)
    makes the text before the reply's first ``</think>`` reasoning. Otherwise only a block the reply opens
    itself, first thing, is reasoning; a stray ``</think>`` elsewhere is text, like any other."""

    open_tag = "<think>"
    close_tag = "</think>"

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        stripped = text.lstrip()
        if stripped.startswith(self.open_tag):
            stripped, opened = stripped.removeprefix(self.open_tag), True
        if not opened:
            return None, text
        head, closed, tail = stripped.partition(self.close_tag)
        return (head.strip() or None), (tail.lstrip("\n") if closed else "")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class HermesToolCallParser:
    """Qwen/Hermes style: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Structure-based: after the opening tag (and whitespace) one JSON object is decoded in place; the call
    is accepted when whitespace and the closing tag follow it. A block whose body is not a JSON object
    with a string ``name`` is left in the content: the client sees what the model wrote instead of a
    silently dropped call.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    # strict=False: a grammar backend may admit raw control characters inside length-bounded strings
    # (xgrammar does); they are data, and json.dumps below re-escapes them for the client. NaN and Infinity
    # are not JSON: a body holding them is not a call.
    _decoder = json.JSONDecoder(strict=False, parse_constant=_reject_constant)

    def _call_at(self, text: str, start: int) -> tuple[dict[str, Any], int, int] | None:
        """The call object whose opening tag is at ``start``, where the object starts and the end of its closing
        tag, or None."""
        pos = start + len(self.open_tag)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        begin = pos
        try:
            obj, pos = self._decoder.raw_decode(text, pos)
        except ValueError:
            return None
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if (
            not text.startswith(self.close_tag, pos)
            or not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
        ):
            return None
        return obj, begin, pos + len(self.close_tag)

    def _arguments_text(self, obj: dict[str, Any], text: str, begin: int) -> str:
        """The call's arguments as a JSON string: a string as written, anything else re-serialized. A number literal
        past float range (``1e999``) decodes to inf, which json.dumps would write as the non-JSON ``Infinity``:
        such a literal is passed on exactly as the model wrote it."""
        key = "arguments" if "arguments" in obj else "parameters"
        args = obj.get(key, {})
        if isinstance(args, str):
            return args
        try:
            return json.dumps(args, ensure_ascii=False, allow_nan=False)
        except ValueError:
            pass
        nonce, literals = uuid.uuid4().hex, []

        def keep(literal: str) -> Any:
            if math.isfinite(value := float(literal)):
                return value
            literals.append(literal)
            return f"{nonce}{len(literals) - 1}"  # a placeholder string, swapped back for the literal below

        decoder = json.JSONDecoder(strict=False, parse_float=keep, parse_constant=_reject_constant)
        out = json.dumps(decoder.raw_decode(text, begin)[0].get(key), ensure_ascii=False)
        for i, literal in enumerate(literals):
            out = out.replace(json.dumps(f"{nonce}{i}"), literal)
        return out

    def extract(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        pos = search = 0
        while (start := text.find(self.open_tag, search)) >= 0:
            found = self._call_at(text, start)
            if found is None:
                search = start + len(self.open_tag)
                continue
            obj, begin, end = found
            arguments = self._arguments_text(obj, text, begin)
            kept.append(text[pos:start])
            pos = search = end
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "index": len(calls),
                    "type": "function",
                    "function": {
                        "name": obj["name"],
                        "arguments": arguments,
                    },
                }
            )
        kept.append(text[pos:])
        return "".join(kept).strip() if calls else text, calls


DEFAULT_REASONING_PARSER = ThinkReasoningParser()
DEFAULT_TOOL_PARSER = HermesToolCallParser()


def parse_assistant_output(
    text: str,
    *,
    opened: bool = False,
    reasoning_parser: ReasoningParser | None = DEFAULT_REASONING_PARSER,
    tool_parser: ToolCallParser | None = DEFAULT_TOOL_PARSER,
) -> ParsedOutput:
    reasoning: str | None = None
    body = text
    if reasoning_parser is not None:
        reasoning, body = reasoning_parser.split(text, opened)
    calls: list[dict[str, Any]] = []
    if tool_parser is not None:
        body, calls = tool_parser.extract(body)
    return ParsedOutput(content=body, reasoning_content=reasoning, tool_calls=calls)


def prompt_opens_think(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` block open for the reply (a template that starts every
    reply in reasoning, e.g. DeepSeek-R1's or Qwen3's thinking-only ones). Reads the last few tokens only."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return str(tail).rstrip().endswith(ThinkReasoningParser.open_tag)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages with content parts joined to text and ``None`` content as ``""``; tool calls as sent (the
    render gives each template the form it needs: engine.template_inputs)."""
    return template_messages(messages, arguments_mapping=False)


# Template texts that take tool-call arguments as the JSON strings the client sent (see render_prompt_text).
_STRING_ARGUMENT_TEMPLATES: set[str] = set()


@functools.lru_cache(maxsize=8)
def _family_of(source: str) -> ChatFamily:
    return detect_family(source)


def template_family(tokenizer: Any) -> ChatFamily:
    """The family of the tokenizer's chat template (engine.chat_families), cached per template text."""
    return _family_of(template_source(tokenizer))


def render_prompt_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The template's rendering; what the template raises is a :class:`~engine.template_inputs.TemplateRefused`.

    Tool-call arguments go in as mappings; a template that refuses them so and renders them as written (it
    concatenates them as strings) gets them as written, learned once per template text."""
    source = template_source(tokenizer)
    id_form = _family_of(source).id_form
    tools_in = template_tools(tools)

    def render(arguments_mapping: bool) -> Any:
        return tokenizer.apply_chat_template(
            template_messages(messages, id_form, arguments_mapping=arguments_mapping),
            tools=tools_in,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )

    mapping = source not in _STRING_ARGUMENT_TEMPLATES
    try:
        text = render(mapping)
    except TEMPLATE_FAILURES as exc:
        if not mapping or not any(m.get("tool_calls") for m in messages):
            raise refusal(exc) from exc
        try:
            text = render(False)
        except TEMPLATE_FAILURES:
            raise refusal(exc) from exc
        _STRING_ARGUMENT_TEMPLATES.add(source)
    return str(text)


# render_prompt_text's parameters on purpose: the same render, as ids.
def render_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the rendered chat prompt; the template already contains every special token."""
    text = render_prompt_text(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(path: str) -> Any:
    """Load a local Hugging Face tokenizer (never from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
