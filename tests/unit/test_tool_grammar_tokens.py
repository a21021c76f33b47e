"""engine.tool_grammar over a vocabulary where each family's markup is one token, as on the real models.

Contract: a forced call's grammar is text (xgrammar EBNF), and xgrammar admits a token when its text fits, so a
family's single special token (Mistral's ``[TOOL_CALLS]``, gpt-oss's ``<|channel|>``, DeepSeek's and Kimi-K2's
section markers, Qwen's ``<tool_call>``) is admitted where the markup starts, and the call sampled with those
tokens runs the grammar to its end, the stop token then the only choice. Compiled as the engines do it (SGLang's
default grammar backend, xgrammar, via the dev engine's ``GrammarBackend``), over the tiny tokenizer with the
markers added as special tokens (the tiny vocabulary spells other families' markup in bytes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from devkit.dev_server.grammar import GrammarBackend
from engine.chat import load_tokenizer
from engine.chat_families import TOOL_CALL_PARSERS
from engine.tool_grammar import forced_tool_grammar
from engine.tool_parsers import call_markup, tool_call_parser
from tests.testkit.chat_templates import TOOLS

pytestmark = pytest.mark.unit
# The markers that are one token on the real models: ``<|...|>``, DeepSeek's ``<｜...｜>``, Mistral's and Qwen's tags.
MARKER = re.compile(r"<\|[^|]+\|>|<｜[^｜]+｜>|\[TOOL_CALLS\]|</?tool_call>")
FAMILIES = [p for p in TOOL_CALL_PARSERS if MARKER.search("".join(call_markup(p, "rename")))]


def _tokenizer_with_markers(model_dir: Path, markers: list[str]) -> Any:
    tok = load_tokenizer(str(model_dir))
    tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    return tok


def _allowed(state: Any, vocab_size: int) -> set[int]:
    logits = torch.zeros(vocab_size)
    state.mask_logits(logits)
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


@pytest.mark.parametrize("parser", FAMILIES)
def test_single_token_markup_is_admitted_and_completes_the_call(tiny_model_dir: Path, parser: str) -> None:
    head, tail = call_markup(parser, "rename")
    markers = sorted(set(MARKER.findall(head + tail)))
    tok = _tokenizer_with_markers(tiny_model_dir, markers)
    marker_ids = {tok.convert_tokens_to_ids(m) for m in markers}
    call = head + json.dumps({"to": "b.txt"}) + tail
    ids = tok.encode(call, add_special_tokens=False)
    assert marker_ids <= set(ids)  # the call as the real model samples it: each marker one token
    source = forced_tool_grammar(TOOLS, "required", parser)
    assert source is not None
    state = GrammarBackend(tok, len(tok), [tok.eos_token_id]).matchers("ebnf", source, 1)[0]
    for position, token in enumerate(ids):
        assert token in _allowed(state, len(tok)), (position, tok.convert_ids_to_tokens(token))
        assert state.accept(token)
    assert _allowed(state, len(tok)) == {tok.eos_token_id}  # the call is complete: only the stop remains
    assert state.accept(tok.eos_token_id) and state.terminated
    _, calls = tool_call_parser(parser).extract(tok.decode(ids, skip_special_tokens=False))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("rename", {"to": "b.txt"})
    ]


def test_mistral_opens_with_its_single_token_or_its_spelling(tiny_model_dir: Path) -> None:
    tok = _tokenizer_with_markers(tiny_model_dir, ["[TOOL_CALLS]"])
    state = GrammarBackend(tok, len(tok), [tok.eos_token_id]).matchers(
        "ebnf", str(forced_tool_grammar(TOOLS, "required", "mistral")), 1
    )[0]
    first = {tok.convert_ids_to_tokens(i) for i in _allowed(state, len(tok))}
    # The special token, or the text it spells from its first byte on: the model's own choice, its log-prob kept.
    assert "[TOOL_CALLS]" in first and first <= {"[TOOL_CALLS]", "["}
