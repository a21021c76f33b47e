"""Constrained decoding with xgrammar, the grammar backend SGLang uses by default.

Contract: a grammar (``regex``, ``json_schema`` or
``ebnf`` sampling parameter) is compiled once per distinct source and cached; each sample keeps its
own matcher. Before each step the matcher fills a token bitmask that is applied to the logits in place;
the chosen token is fed back. The stop token is admitted only once the grammar is complete, and a
terminated matcher ends the sample with ``finish_reason {"type": "stop", "matched": <stop id>}`` as in
SGLang's ``check_finished``. An invalid grammar is the caller's error (``GrammarError`` -> HTTP 400).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import xgrammar as xgr


class GrammarError(ValueError):
    """The grammar source does not compile."""


class GrammarBackend:
    """Compiles grammars for one tokenizer/vocabulary; thread-safe, compiled grammars cached by source."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def compile(self, kind: str, source: str) -> Any:
        key = (kind, source)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            try:
                if kind == "regex":
                    compiled = self._compiler.compile_regex(source)
                elif kind == "json_schema":
                    compiled = self._compiler.compile_json_schema(source)
                elif kind == "ebnf":
                    compiled = self._compiler.compile_grammar(source)
                else:
                    raise GrammarError(f"unknown grammar kind {kind!r}")
            except GrammarError:
                raise
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad sources
                raise GrammarError(f"invalid {kind}: {exc}") from exc
            self._cache[key] = compiled
            return compiled

    def matchers(self, kind: str, source: str, n: int) -> list[GrammarState]:
        compiled = self.compile(kind, source)
        return [GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size) for _ in range(n)]


class GrammarState:
    """One sample's matcher plus its bitmask buffer."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask_logits(self, logits_row: torch.Tensor) -> None:
        """Set every token the grammar forbids next to -inf, in place on a (V,) row."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        row = logits_row.view(1, -1)
        xgr.apply_token_bitmask_inplace(row, self._bitmask, vocab_size=self.vocab_size)

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
