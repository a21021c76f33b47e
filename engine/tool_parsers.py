"""Tool-call and reasoning parsers per model family, by SGLang's parser names, and their forced-call markup.

Role: ``tool_call_parser(name, id_form)`` and ``reasoning_parser(name)`` give the parser that reads a sampled
reply in that family's markup (engine.chat's two interfaces); ``call_markup(name, fn_name)`` gives the text
before and after a forced call's arguments (engine.tool_grammar builds the grammar from it), so a forced
call comes out in the family's own markup and parses back with the same family's parser. Calls are read by
their structure: the arguments are one JSON object decoded where it stands, then the family's closing markup
must follow; a block that does not parse stays in the content. Ids: ``openai`` ``call_<24 hex>``,
``mistral`` 9 alphanumerics (what its template demands), ``kimi`` ``functions.NAME:INDEX`` (Kimi-K2's).
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from typing import Any

from engine.chat import HermesToolCallParser, ReasoningParser, ThinkReasoningParser, ToolCallParser

NewId = Callable[[str, int], str]  # (function name, index of the call in the reply) -> call id
_ALNUM = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder(strict=False)


def new_call_id(id_form: str) -> NewId:
    """The id maker of an id form (see the module docstring)."""
    if id_form == "mistral":
        return lambda name, index: "".join(secrets.choice(_ALNUM) for _ in range(9))
    if id_form == "kimi":
        return lambda name, index: f"functions.{name}:{index}"
    return lambda name, index: f"call_{uuid.uuid4().hex[:24]}"


def _call(new_id: NewId, name: str, arguments: Any, index: int) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_id(name, index),
        "index": index,
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after whitespace) and where it ends, or None."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


class MarkedCallParser:
    """Calls framed by markers: ``section_open (call_open NAME name_sep ARGS call_close)+ section_close``.

    DeepSeek-V3.1 (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}<｜tool▁call▁end｜>``) and Kimi-K2
    (``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{..}<|tool_call_end|>``, whose name
    carries a ``functions.`` prefix and a ``:index`` suffix) write their calls so."""

    def __init__(self, section: tuple[str, str], call: tuple[str, str, str], new_id: NewId, kimi: bool = False):
        self.open_tag, self.section_close = section
        self.call_open, self.name_sep, self.call_close = call
        self.new_id, self.kimi = new_id, kimi

    def _name(self, raw: str) -> str:
        name = raw.strip()
        if self.kimi:
            name = name.removeprefix("functions.").rsplit(":", 1)[0]
        return name

    def _call_at(self, text: str, at: int) -> tuple[str, dict[str, Any], int] | None:
        """(name, arguments, end of the call's closing marker) of the call opened at ``at``, or None."""
        sep = text.find(self.name_sep, at)
        if sep < 0:
            return None
        found = _json_at(text, sep + len(self.name_sep))
        if found is None or not isinstance(found[0], dict):
            return None
        end = found[1]
        while end < len(text) and text[end].isspace():
            end += 1
        if not text.startswith(self.call_close, end):
            return None
        return self._name(text[at + len(self.call_open) : sep]), found[0], end + len(self.call_close)

    def extract(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        start = text.find(self.open_tag)
        if start < 0:
            return text, []
        calls: list[dict[str, Any]] = []
        pos = start + len(self.open_tag)
        while (at := text.find(self.call_open, pos)) >= 0 and not text[pos:at].strip():
            found = self._call_at(text, at)
            if found is None:
                break
            name, args, pos = found
            calls.append(_call(self.new_id, name, args, len(calls)))
        if not calls:
            return text, []
        rest = text[pos:].lstrip()
        rest = rest.removeprefix(self.section_close)
        return (text[:start] + rest).strip(), calls


class FencedCallParser(MarkedCallParser):
    """DeepSeek-V3 and the R1 distills: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{..}\n```
    <｜tool▁call▁end｜>`` (the type before the separator, the arguments in a fenced JSON block)."""

    fence_open, fence_close = "\n```json\n", "\n```"

    def _call_at(self, text: str, at: int) -> tuple[str, dict[str, Any], int] | None:
        sep = text.find(self.name_sep, at)
        fence = text.find(self.fence_open, sep) if sep >= 0 else -1
        if fence < 0:
            return None
        found = _json_at(text, fence + len(self.fence_open))
        if found is None or not isinstance(found[0], dict):
            return None
        end = found[1]
        closing = self.fence_close.lstrip("\n")
        while end < len(text) and text[end].isspace():
            end += 1
        if not text.startswith(closing, end) or not text.startswith(self.call_close, end + len(closing)):
            return None
        name = text[sep + len(self.name_sep) : fence].strip()
        return name, found[0], end + len(closing) + len(self.call_close)


class JsonCallsParser:
    """Calls as JSON objects ``{"name": .., "arguments"|"parameters": {..}}`` after a marker.

    Mistral: ``[TOOL_CALLS][{..}, ..]`` (a JSON list). Llama 3: ``<|python_tag|>{..}`` or a reply that is
    only ``{..}`` objects separated by ``;``."""

    def __init__(self, open_tag: str, new_id: NewId, *, bare_start: bool = False) -> None:
        self.open_tag, self.new_id, self.bare_start = open_tag, new_id, bare_start

    @staticmethod
    def _is_call(obj: Any) -> bool:
        return (
            isinstance(obj, dict)
            and isinstance(obj.get("name"), str)
            and isinstance(obj.get("arguments", obj.get("parameters", {})), dict | str)
        )

    def extract(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        start = text.find(self.open_tag) if self.open_tag else -1
        if start >= 0:
            pos = start + len(self.open_tag)
        elif self.bare_start and text.lstrip().startswith("{"):
            start = pos = len(text) - len(text.lstrip())
        else:
            return text, []
        objs: list[Any] = []
        while (found := _json_at(text, pos)) is not None:
            value, pos = found
            objs.extend(value if isinstance(value, list) else [value])
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
        if not objs or not all(self._is_call(o) for o in objs) or text[pos:].strip():
            return text, []
        calls = [
            _call(self.new_id, o["name"], o.get("arguments", o.get("parameters", {})), i) for i, o in enumerate(objs)
        ]
        return text[:start].strip(), calls


class HarmonyCallParser:
    """gpt-oss (harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>``
    (the recipient may also stand before the channel)."""

    open_tag = "to=functions."

    def __init__(self, new_id: NewId) -> None:
        self.new_id = new_id

    def extract(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        first = -1
        pos = 0
        while (at := text.find(self.open_tag, pos)) >= 0:
            name_end = at + len(self.open_tag)
            while name_end < len(text) and not text[name_end].isspace() and not text.startswith("<|", name_end):
                name_end += 1
            msg = text.find("<|message|>", name_end)
            found = _json_at(text, msg + len("<|message|>")) if msg >= 0 else None
            if found is None or not isinstance(found[0], dict):
                break
            first = at if first < 0 else first
            calls.append(_call(self.new_id, text[at + len(self.open_tag) : name_end], found[0], len(calls)))
            pos = found[1]
            pos += len("<|call|>") if text.startswith("<|call|>", pos) else 0
        if not calls:
            return text, []
        head = text[:first]
        head = head[: head.rfind("<|channel|>")] if "<|channel|>" in head else head
        return head.strip(), calls


class HarmonyReasoningParser:
    """gpt-oss: the ``analysis`` channel is the reasoning, the ``final`` channel the content."""

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        marker = "<|channel|>analysis<|message|>"
        at = text.find(marker)
        if at < 0:
            final = text.find("<|channel|>final<|message|>")
            return None, text[final + len("<|channel|>final<|message|>") :] if final >= 0 else text
        end = text.find("<|end|>", at)
        reasoning = text[at + len(marker) : end if end >= 0 else len(text)]
        rest = text[end + len("<|end|>") :] if end >= 0 else ""
        final = rest.find("<|channel|>final<|message|>")
        content = rest[final + len("<|channel|>final<|message|>") :] if final >= 0 else rest
        return reasoning.strip() or None, content.removesuffix("<|return|>")


_DS = (
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
)
_KIMI = (
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    (
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
)


class _Hermes(HermesToolCallParser):
    def __init__(self, new_id: NewId) -> None:
        self.new_id = new_id

    def extract(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = super().extract(text)
        for call in calls:
            call["id"] = self.new_id(call["function"]["name"], call["index"])
        return content, calls


def tool_call_parser(name: str, id_form: str = "openai") -> ToolCallParser:
    """The parser of SGLang's ``--tool-call-parser`` ``name``; ids in ``id_form`` (Kimi-K2's own for kimi_k2)."""
    new_id = new_call_id("kimi" if name == "kimi_k2" else id_form)
    if name in ("qwen25", "hermes"):
        return _Hermes(new_id)
    if name == "llama3":
        return JsonCallsParser("<|python_tag|>", new_id, bare_start=True)
    if name == "mistral":
        return JsonCallsParser("[TOOL_CALLS]", new_id)
    if name == "deepseekv31":
        return MarkedCallParser(*_DS, new_id)
    if name == "deepseekv3":
        return FencedCallParser(*_DS, new_id)
    if name == "kimi_k2":
        return MarkedCallParser(*_KIMI, new_id, kimi=True)
    if name == "gpt-oss":
        return HarmonyCallParser(new_id)
    raise ValueError(f"unknown tool-call parser {name!r}")


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of SGLang's ``--reasoning-parser`` ``name``; None: no reasoning split."""
    if name is None:
        return None
    if name in ("qwen3", "deepseek-r1"):  # <think>..</think>; R1's prompt opens the block (prompt_opens_think)
        return ThinkReasoningParser()
    if name == "gpt-oss":
        return HarmonyReasoningParser()
    raise ValueError(f"unknown reasoning parser {name!r}")


def call_markup(name: str, fn_name: str) -> tuple[str, str]:
    """The text before and after a forced call's JSON arguments in parser ``name``'s family markup."""
    quoted = json.dumps(fn_name)
    if name == "llama3":
        return '{"name": ' + quoted + ', "parameters": ', "}"
    if name == "mistral":
        return '[TOOL_CALLS][{"name": ' + quoted + ', "arguments": ', "}]"
    if name == "deepseekv31":
        return _DS[0][0] + _DS[1][0] + fn_name + _DS[1][1], _DS[1][2] + _DS[0][1]
    if name == "deepseekv3":
        fence = FencedCallParser.fence_open, FencedCallParser.fence_close
        return _DS[0][0] + _DS[1][0] + "function" + _DS[1][1] + fn_name + fence[0], fence[1] + _DS[1][2] + _DS[0][1]
    if name == "kimi_k2":
        return _KIMI[0][0] + _KIMI[1][0] + f"functions.{fn_name}:0" + _KIMI[1][1], _KIMI[1][2] + _KIMI[0][1]
    if name == "gpt-oss":
        return f"<|channel|>commentary to=functions.{fn_name} <|constrain|>json<|message|>", "<|call|>"
    return '<tool_call>\n{"name": ' + quoted + ', "arguments": ', "}\n</tool_call>"
