"""Values in the form a model's chat template expects, and its refusals as one typed error.

Role: the one place between OpenAI-shaped messages/tools and ``apply_chat_template``. Contract:

- ``template_messages``: content parts joined to text, ``None`` content as ``""``; a tool call's
  ``arguments`` JSON string becomes the mapping it encodes (templates iterate it or ``tojson`` it, as vLLM
  passes them); a string that is not a JSON object stays as written. A template that refuses the mapping
  (it concatenates ``arguments`` as a string) gets the string as written instead (engine.chat). Where the template's family demands
  another tool-call id form (Mistral: 9 alphanumerics), every id (the calls' and the tool results'
  ``tool_call_id``) is mapped to that form by one deterministic function, so a call and its result still
  match. The input is never mutated.
- ``template_tools``: a function without ``description``/``parameters`` gets the empty ones (templates read
  them unguarded).
- ``TemplateRefused``: what a template raised (``raise_exception``, a value it cannot render): the request
  is what the template refuses, so the policy server answers it with a 400 naming the complaint.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

import jinja2

MISTRAL_ID_CHARS = 9
_ALNUM = set(string.ascii_letters + string.digits)
# What a template's own code raises when the values it is given do not fit it (jinja's TemplateError covers
# raise_exception and undefined attributes; the others come from filters and Python methods it calls).
TEMPLATE_FAILURES: tuple[type[Exception], ...] = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    KeyError,
    AttributeError,
    IndexError,
)


class TemplateRefused(Exception):
    """The chat template would not render the conversation; ``message`` says what it complained about."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def refusal(exc: Exception) -> TemplateRefused:
    """The typed refusal for an exception raised while rendering."""
    detail = str(exc) or type(exc).__name__
    return TemplateRefused(f"the model's chat template refused the conversation: {detail}")


def mistral_tool_call_id(call_id: str) -> str:
    """A 9-alphanumeric id for ``call_id`` (Mistral's templates refuse any other): the last nine alphanumerics
    when it has them (an id already in that form stays as is), else nine derived from its hash."""
    alnum = "".join(ch for ch in call_id if ch in _ALNUM)
    if len(alnum) >= MISTRAL_ID_CHARS:
        return alnum[-MISTRAL_ID_CHARS:]
    digest = hashlib.sha256(call_id.encode()).hexdigest()
    return digest[:MISTRAL_ID_CHARS]


def _arguments(value: Any) -> Any:
    """The mapping a JSON-object string encodes; anything else as it is. A number past float range (``1e999``)
    would come back as the non-JSON ``Infinity`` in the template's ``tojson``: such a string stays as written."""
    if not isinstance(value, str):
        return value
    try:
        decoded = json.loads(value)
        if isinstance(decoded, dict):
            json.dumps(decoded, allow_nan=False)
            return decoded
    except ValueError:
        pass
    return value


def _tool_calls(calls: list[Any], id_form: str | None, mapping: bool) -> list[Any]:
    out: list[Any] = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(call)
            continue
        c = dict(call)
        fn = c.get("function")
        if mapping and isinstance(fn, dict) and "arguments" in fn:
            c["function"] = dict(fn, arguments=_arguments(fn["arguments"]))
        if id_form == "mistral" and isinstance(c.get("id"), str):
            c["id"] = mistral_tool_call_id(c["id"])
        out.append(c)
    return out


def template_messages(
    messages: list[dict[str, Any]], id_form: str | None = None, *, arguments_mapping: bool = True
) -> list[dict[str, Any]]:
    """The messages as the template renders them (see the module docstring); ``id_form`` ``"mistral"`` maps
    tool-call ids to Mistral's form; ``arguments_mapping=False`` keeps ``arguments`` as written (a template
    that concatenates them as a string, DeepSeek-V3.1's)."""
    out = []
    for msg in messages:
        m = dict(msg)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(
                part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
            )
        elif content is None:
            m["content"] = ""
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = _tool_calls(m["tool_calls"], id_form, arguments_mapping)
        if id_form == "mistral" and isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = mistral_tool_call_id(m["tool_call_id"])
        out.append(m)
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool definitions with the fields templates read unguarded filled in; None for no tools."""
    if not tools:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and ("description" not in fn or "parameters" not in fn):
            fn = {"description": "", "parameters": {"type": "object", "properties": {}}, **fn}
            tool = dict(tool, function=fn)
        out.append(tool)
    return out
