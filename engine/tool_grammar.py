"""Typed forced tool calls and JSON response formats as engine grammars (shared by the policy server and
the dev engine's OpenAI endpoint).

Role: OpenAI's ``tool_choice`` other than auto/none must yield a tool call whose arguments are valid for
the function's JSON schema. The caller asks the engine for constrained decoding with SGLang's
``ebnf`` sampling parameter (xgrammar syntax, SGLang's default grammar backend; the dev engine compiles it
with the same library) of exactly one call in the model family's markup (engine.tool_parsers.call_markup), by
default the Hermes/Qwen block::

    <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>

that the same family's parser (``engine.tool_parsers.tool_call_parser``) reads back.

The call's JSON strings (values and keys) cannot hold a raw ``<``: every special or markup token of the
Hermes/ChatML family starts with it (``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``,
``<|im_end|>``...), so a sampled string can never spell one; the character is still reachable as the JSON
escape ``\\u003c``, which decodes to ``<`` in the arguments the client gets. Without this a string could
end the call early (or open a reasoning block) once the history is re-rendered and re-tokenized.

Stop sequences do not apply inside the forced call: the grammar ends with the call, so a client's
``stop`` could only cut the call's own markup (leaving neither call nor content). A forced request is sent
to the engine without ``stop``; stops apply to text after the call, and a forced reply has none. ``ARGS`` is xgrammar's own JSON-schema grammar of the
function's ``parameters`` (compact separators ``", "``/``": "``; strict: no properties beyond the schema's),
so arrays, nested objects, integers, numbers, booleans, enums, ``anyOf``/nullable fields and local
``$ref``/``$defs`` come back typed and valid. ``"required"`` with several tools is the union of their
blocks; one call per turn either way (``parallel_tool_calls`` needs no more). A schema that cannot be
constrained (not an object schema, an unknown type, a ``$ref`` outside the document, a pattern xgrammar
does not support) is the client's error: :class:`GrammarRefused` naming the tool and the field (HTTP 400).

``response_format`` ``json_object``/``json_schema`` use SGLang's ``ebnf`` sampling parameter too: xgrammar's
grammar of the schema, built here, so a bad schema is a 400 and never an engine error. Every grammar built here
fixes one thing in xgrammar's: a length-bounded string (``minLength``/``maxLength``) admits raw control
characters (U+0000-U+001F) and no escapes, so a sampled value could be invalid JSON; here its characters are
JSON string characters (:func:`json_bounded_strings`), so the text the engine samples is the JSON the client
parses, token for token (nothing is re-escaped after sampling).

The sampled ids stay the model's own samples, but their log-probs are not the model's: the engine
renormalises over the tokens the grammar allows, so a constrained step's log-prob is
log p(token | allowed). The turn record and its sample therefore say ``constrained: true``
(CONTRACTS.md), so the trainer does not treat those log-probs as comparable with recomputed ones.

xgrammar (and the torch it loads, seconds of start-up) is imported on the first grammar built, so a server
that never constrains a request never pays for it.
"""

from __future__ import annotations

import functools
import json
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any

from engine.tool_parsers import call_markup
from engine.validation import clip

if TYPE_CHECKING:
    import xgrammar as xgr

GRAMMAR_KEYS = ("regex", "json_schema", "ebnf")  # SGLang takes at most one of them per request


def is_constrained(sampling_params: dict[str, Any]) -> bool:
    """Whether SGLang sampling params decode under a grammar (any of :data:`GRAMMAR_KEYS` set): the one
    answer to "was this turn constrained?". Such a turn's log-probs are the masked distribution's."""
    return any(sampling_params.get(k) is not None for k in GRAMMAR_KEYS)


class GrammarRefused(ValueError):
    """The request's tools, tool_choice or response_format cannot be constrained: the client's error."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


_EMPTY_OBJECT = {"type": "object", "properties": {}}


@functools.cache
def _xgrammar() -> ModuleType:
    import xgrammar

    return xgrammar


def _external_ref(schema: Any) -> str | None:
    """The first ``$ref`` that does not point into the schema itself (xgrammar would silently allow anything)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            return ref
        return next((r for v in schema.values() if (r := _external_ref(v)) is not None), None)
    if isinstance(schema, list):
        return next((r for v in schema if (r := _external_ref(v)) is not None), None)
    return None


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema_json: str) -> xgr.Grammar:
    return _xgrammar().Grammar.from_json_schema(schema_json, any_whitespace=False)


def schema_grammar(schema: dict[str, Any], what: str, param: str) -> xgr.Grammar:
    """xgrammar's grammar of a JSON schema, or a 400 that says why it cannot be constrained."""
    ref = _external_ref(schema)
    if ref is not None:
        raise GrammarRefused(
            f"{what}: $ref {ref!r} points outside the schema; only local refs (#/...) can be constrained", param=param
        )
    try:
        return _schema_grammar(json.dumps(schema))  # key order kept: properties come out in schema order
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports unsupported schemas as RuntimeError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GrammarRefused(f"{what} cannot be constrained: {reason.split('] ')[-1]}", param=param) from None


def _parameters(fn: dict[str, Any], index: int) -> dict[str, Any]:
    params = fn.get("parameters")
    if params is None:
        return dict(_EMPTY_OBJECT)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise GrammarRefused(
            f"tools[{index}].function.parameters must be a JSON schema of type object to be forced",
            param=f"tools[{index}].function.parameters",
        )
    return params


def _call_grammar(fn: dict[str, Any], index: int, parser: str) -> xgr.Grammar:
    head, tail = call_markup(parser, fn["name"])
    args = schema_grammar(
        _parameters(fn, index), f"tools[{index}] ({fn['name']}) parameters", f"tools[{index}].function.parameters"
    )
    grammar = _xgrammar().Grammar
    return grammar.concat(
        grammar.from_ebnf("root ::= " + json.dumps(head)),
        args,
        grammar.from_ebnf("root ::= " + json.dumps(tail)),
    )


# xgrammar's rule for one character of a length-bounded string (``minLength``/``maxLength``: the rule is repeated
# ``{min, max}`` times) admits every character but the quote, the backslash, CR and LF: the other controls
# (U+0000-U+001F) come out raw, which is no JSON (``json.loads`` refuses ``"a\x0bb"``), and escapes not at all.
_BOUNDED_CHAR_RULE = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# One JSON string character: a raw one that JSON allows, or one escape (each counts once against maxLength,
# as the decoded string's length does).
_JSON_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'


def json_bounded_strings(ebnf: str) -> str:
    """``ebnf`` whose length-bounded string characters are JSON string characters (raw controls excluded,
    escapes allowed), so what the grammar admits always parses as JSON."""
    return _BOUNDED_CHAR_RULE.sub(lambda m: f"{m.group(1)} ::= {_JSON_CHAR}", ebnf)


# A negated character class of a JSON string's characters in xgrammar's EBNF (it excludes the quote).
_STRING_CHARS = re.compile(r'\[\^((?:[^\]\\]|\\.)*\\"(?:[^\]\\]|\\.)*)\]')


def exclude_markup_from_strings(ebnf: str) -> str:
    """``ebnf`` with ``<`` removed from every JSON-string character class (see the module docstring)."""
    return _STRING_CHARS.sub(lambda m: m.group(0) if "<" in m.group(1) else f"[^{m.group(1)}<]", ebnf)


def forced_tool_grammar(tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str = "qwen25") -> str | None:
    """The ``ebnf`` source for ``tool_choice``, or None when the model chooses freely (auto/none/absent); the
    call in the markup of tool-call parser ``parser``'s family (engine.tool_parsers.call_markup)."""
    if tool_choice in (None, "auto", "none"):
        return None
    indexed = [(i, t["function"]) for i, t in enumerate(tools or [])]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        indexed = [(i, f) for i, f in indexed if f.get("name") == name]
        if not indexed:
            raise GrammarRefused(f"tool_choice names function {clip(name)}, which is not in tools", param="tool_choice")
    grammars = [_call_grammar(f, i, parser) for i, f in indexed]
    grammar = grammars[0] if len(grammars) == 1 else _xgrammar().Grammar.union(*grammars)
    return exclude_markup_from_strings(json_bounded_strings(str(grammar)))


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for, or None for text/absent; a bad one is :class:`GrammarRefused`."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarRefused(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return schema
    raise GrammarRefused(
        f"response_format.type {clip(kind)} must be text, json_object or json_schema", param="response_format.type"
    )


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """SGLang's ``ebnf`` sampling parameter for ``response_format`` (xgrammar's grammar of its schema, with
    JSON string characters in bounded strings), or None for text/absent."""
    schema = response_format_schema(response_format)
    if schema is None:
        return None
    param = "response_format.json_schema.schema"
    return json_bounded_strings(str(schema_grammar(schema, param, param)))
