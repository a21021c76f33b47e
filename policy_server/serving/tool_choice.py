"""Forced tool calls and JSON response formats for the policy server: engine.tool_grammar's grammars, its
refusals as 400s.

Contract: see engine.tool_grammar (the grammar of one Hermes/Qwen call per forced turn, strings that cannot
spell markup, no stop sequences inside the call, ``response_format`` as the ``ebnf`` of its schema, bounded strings
of JSON characters only). A tool,
``tool_choice`` or schema that cannot be constrained is :class:`~policy_server.errors.InvalidRequest` naming
the field.
"""

from __future__ import annotations

from engine import tool_grammar
from engine.tool_grammar import GrammarRefused, exclude_markup_from_strings
from policy_server.errors import InvalidRequest

__all__ = ["exclude_markup_from_strings", "forced_tool_grammar", "response_format_grammar"]


def forced_tool_grammar(
    tools: list[dict[str, object]] | None, tool_choice: object, parser: str = "qwen25"
) -> str | None:
    """The ``ebnf`` source for ``tool_choice`` in tool-call parser ``parser``'s markup, or None when the model
    chooses freely (auto/none/absent)."""
    try:
        return tool_grammar.forced_tool_grammar(tools, tool_choice, parser)
    except GrammarRefused as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None


def response_format_grammar(response_format: dict[str, object] | None) -> str | None:
    """SGLang's ``ebnf`` sampling parameter for ``response_format``, or None for text/absent."""
    try:
        return tool_grammar.response_format_grammar(response_format)
    except GrammarRefused as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None
