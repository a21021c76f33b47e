"""Forced tool calls (``tool_choice: "required"`` or a named function) as a regex constraint.

Role: OpenAI's ``tool_choice`` other than auto/none must yield a tool call; the policy server asks the
engine for constrained decoding (SGLang's ``regex`` sampling parameter, also in the dev engine) of the
Hermes/Qwen block ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` that
``engine.chat.HermesToolCallParser`` parses. Arguments follow the function's JSON schema for flat
objects (string/integer/number/boolean/enum properties, in schema order, all present); other schemas
fall back to a flat JSON object of string values. The sampled ids stay the model's own samples, but
their log-probs are not the model's: the engine renormalises over the tokens the regex allows, so a
rollout log-prob of a constrained step is log p(token | allowed) (several nats above the model's own on
a tiny random model). The turn record and its sample therefore say ``constrained: true`` (CONTRACTS.md),
so the trainer does not treat those log-probs as comparable with recomputed ones.
"""

from __future__ import annotations

import json
import re
from typing import Any

from policy_server.errors import InvalidRequest

_STRING = r'"[A-Za-z0-9 _.,:/-]{0,40}"'
_VALUES = {
    "string": _STRING,
    "integer": r"-?[0-9]{1,9}",
    "number": r"-?[0-9]{1,9}(\.[0-9]{1,6})?",
    "boolean": r"(true|false)",
}


def _value_regex(schema: dict[str, Any]) -> str:
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + "|".join(re.escape(json.dumps(v)) for v in schema["enum"]) + ")"
    return _VALUES.get(str(schema.get("type")), _STRING)


def _arguments_regex(parameters: dict[str, Any] | None) -> str:
    props = (parameters or {}).get("properties")
    if not isinstance(props, dict) or not props:
        return r"\{\}"
    parts = [re.escape(json.dumps(name)) + ": " + _value_regex(s if isinstance(s, dict) else {})
             for name, s in props.items()]
    return r"\{" + ", ".join(parts) + r"\}"


def _call_regex(fn: dict[str, Any]) -> str:
    name = re.escape(json.dumps(fn["name"]))
    return r"<tool_call>\n\{" + re.escape('"name": ') + name + re.escape(', "arguments": ') + \
        _arguments_regex(fn.get("parameters")) + r"\}\n</tool_call>"


def forced_tool_regex(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """The regex for ``tool_choice``, or None when the model chooses freely (auto/none/absent)."""
    if tool_choice in (None, "auto", "none"):
        return None
    fns = [t["function"] for t in tools or []]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        fns = [f for f in fns if f.get("name") == name]
        if not fns:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return "(" + "|".join(_call_regex(f) for f in fns) + ")"
