"""Token-continuous prompts: a request that extends a recorded turn continues that turn's exact ids.

Role: the one place that turns (a recorded turn, the request's messages) into prompt ids. Every request
shape the policy server speaks ends up here, so every shape gets the same continuity. Pure and synchronous
(``ContinuationRenderer.render``); callers may run it on a worker thread.

Contract. A request with messages ``M + [a] + N`` that extends a recorded turn T (T's request messages
``M``, T's prompt ids ``P``, its sampled ids ``R``; ``a`` is the client's copy of T's reply, ``N`` the new
messages) gets the prompt

    P + R + tokens(close' + suffix)

where ``suffix`` is the template's own rendering of ``N`` and the generation prompt, and ``close'`` is
what the template writes after an assistant message's content (``<|im_end|>\\n`` for ChatML), minus the
stop token when ``R`` already ends with it. The render and tokenization cost depends on ``N`` only, never
on the history. Every earlier token stays exactly what was sent or sampled, so the engine's prefix cache
holds and every trained token is the sampled token with its own log-prob.

The suffix is rendered against a short synthetic conversation of the same shape (same system-message
presence, a reply with the same parts, the same tools and template arguments), ``base``:
``suffix = render(base + N, generation prompt) - render(base)``. This is exact for templates that are
**append-only**: appending messages never changes the text rendered for the ones before, and an
assistant message's rendering starts with the generation prompt. That is checked per shape (a probe on
synthetic messages, cached) and, on sampled continued turns, against the full render of the real
messages (text only: ``render(M + [a])`` starts with ``render(M, gen)`` and ends with the closing, and
``render(M + [a] + N, gen) == render(M + [a]) + suffix``); a failed verification turns that shape off for
the process lifetime.

History modes (``history``). ``sampled`` (the default): a template that rewrites history for the shape or the
turn (it drops earlier turns' reasoning once a new user message arrives, as Qwen3's and DeepSeek-R1's do; its
generation prompt is not how it renders the reply later, as Qwen3's empty ``<think></think>`` block with
thinking off; it moves the system prompt to the last user turn, as Mistral's does; a failed verification)
still gets ``P + R + tokens(after)``, reason ``continued_over_rewrite``: ``after`` is what the template writes
after the reply, located in a render of the real system message, stand-ins for the last messages before the
reply, the reply (content and arguments a marker) and the real ``N`` (see ``_after_reply``); the earlier
turns stay exactly as sent and sampled. The same budget checks these turns against the full render of the real
messages (text: it ends with ``after``, the closing included, so the stand-ins rendered ``N`` as the whole
conversation does); a failed check makes that shape's turns full renders (``verify_mismatch``) for the process
lifetime. Only ``N``'s rendering can be checked: ``P + R`` deliberately differ from the template's render of the
earlier turns. ``template``: every turn is the template's full render of the whole
conversation (reason ``history_template``), as the model card intends; the sampled ids of earlier replies are
then re-tokenized from their text. Other reasons (full renders in both modes): ``no_prior_turn``,
``not_an_extension`` (the messages do not extend T's), ``tools_changed``, ``template_kwargs_changed``;
``template_rewrites_history`` and ``verify_mismatch`` are the full render's reasons when even the stand-ins
are refused by the template, or their rendering of ``N`` failed the check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.chat import render_prompt_ids, render_prompt_text
from engine.records import TurnRecord
from engine.reply_tail import after_reply, stand_in_calls
from engine.template_inputs import TemplateRefused

CONTINUED = "continued"
NO_PRIOR_TURN = "no_prior_turn"
NOT_AN_EXTENSION = "not_an_extension"
TOOLS_CHANGED = "tools_changed"
TEMPLATE_KWARGS_CHANGED = "template_kwargs_changed"
TEMPLATE_REWRITES_HISTORY = "template_rewrites_history"
VERIFY_MISMATCH = "verify_mismatch"
# history=sampled over a template that rewrites history: the prior ids kept, the new messages rendered after the reply.
CONTINUED_OVER_REWRITE = "continued_over_rewrite"
# history=template: the template renders the whole conversation every turn, by configuration.
HISTORY_TEMPLATE = "history_template"
HISTORY_MODES = ("sampled", "template")

# The verification budget holds at most this many turns' worth of credit.
_VERIFY_CREDIT_TURNS = 64
RENDER_REASONS = (
    CONTINUED,
    CONTINUED_OVER_REWRITE,
    HISTORY_TEMPLATE,
    NO_PRIOR_TURN,
    NOT_AN_EXTENSION,
    TOOLS_CHANGED,
    TEMPLATE_KWARGS_CHANGED,
    TEMPLATE_REWRITES_HISTORY,
    VERIFY_MISMATCH,
)
_PROBE_CACHE_SIZE = 512


@dataclass(frozen=True)
class PriorTurn:
    """The recorded turn a request extends: its request messages, tools, template arguments and exact ids."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any] | None
    prompt_ids: list[int]
    response_ids: list[int]

    @classmethod
    def from_turn(cls, turn: TurnRecord) -> PriorTurn:
        """From a recorded turn (engine.records.Turn, as the store reads it). Its lists are shared, not copied
        (a 30k-token prompt would be copied on every turn): neither side changes them."""
        return cls(
            messages=turn.messages,
            tools=turn.tools or None,
            chat_template_kwargs=turn.chat_template_kwargs or None,
            prompt_ids=turn.prompt_ids,
            response_ids=turn.response_ids,
        )


@dataclass(frozen=True)
class Rendered:
    """A prompt: its ids, how it was made (``reason`` is ``continued`` or why it is a full render), the
    number of leading ids taken unchanged from the prior turn, and whether a full render verified it."""

    ids: list[int]
    reason: str
    reused_tokens: int = 0
    verified: bool = False

    @property
    def continued(self) -> bool:
        return self.reason in (CONTINUED, CONTINUED_OVER_REWRITE)


@dataclass(frozen=True)
class _Shape:
    """What a probe learned about one conversation shape (cached per key)."""

    ok: bool
    base: tuple[dict[str, Any], ...] = ()  # the synthetic history the suffix is rendered after
    base_text: str = ""  # render(base), no generation prompt
    close: str = ""  # what the template writes after an assistant message's content
    suffix_needs_tools: bool = True
    # history=sampled: False once a continued_over_rewrite turn of this shape failed the full-render check.
    after_ok: bool = True


def _shape_key(
    messages: list[dict[str, Any]], n_prior: int, tools: Any, kwargs: dict[str, Any] | None
) -> tuple[Any, ...]:
    reply = messages[n_prior]
    tools_hash = hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest() if tools else None
    return (
        tools_hash,
        json.dumps(kwargs or {}, sort_keys=True),
        bool(messages and messages[0].get("role") in ("system", "developer")),
        bool(reply.get("reasoning_content")),
        tuple((tc.get("function") or {}).get("name") for tc in reply.get("tool_calls") or []),
        bool(reply.get("content")),
        tuple((m.get("role"), m.get("tool_call_id"), m.get("name")) for m in messages[n_prior + 1 :]),
    )


def _synthetic(messages: list[dict[str, Any]], n_prior: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(base history without the reply, reply): short stand-ins with the real messages' shape."""
    head: list[dict[str, Any]] = []
    first = messages[0].get("role") if messages else None
    if first in ("system", "developer"):
        head.append({"role": first, "content": "S"})
    head.append({"role": "user", "content": "U"})
    real = messages[n_prior]
    reply: dict[str, Any] = {"role": "assistant", "content": "A" if real.get("content") else ""}
    if real.get("reasoning_content"):
        reply["reasoning_content"] = "R"
    if real.get("tool_calls"):
        reply["tool_calls"] = stand_in_calls(real["tool_calls"])
    return head, reply


class ContinuationRenderer:
    """Renders prompts for one tokenizer/template, continuing recorded turns where the template allows.

    ``verify_tokens_per_turn``: the full-render check of the real messages costs a render of the whole
    history, so it is paid for from a budget that grows by this many history tokens per continued turn; a
    turn is checked when the budget covers its history (which then spends it). The check's CPU per turn is
    therefore the same at any history length: every turn of a short session is checked, one turn in H / T
    of an H-token one. 0 checks none (the per-shape probe still runs); a huge value checks every turn.
    Thread-safe: the shape cache and the budget are guarded by one lock.
    """

    def __init__(self, tokenizer: Any, *, verify_tokens_per_turn: int = 2048, history: str = "sampled") -> None:
        if history not in HISTORY_MODES:
            raise ValueError(f"history must be one of {HISTORY_MODES}, not {history!r}")
        self.tokenizer = tokenizer
        self.history = history
        self.verify_tokens_per_turn = verify_tokens_per_turn
        self._shapes: OrderedDict[tuple[Any, ...], _Shape] = OrderedDict()
        self._lock = threading.Lock()
        self._verify_credit = 0

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prior: PriorTurn | None = None,
    ) -> Rendered:
        """The prompt ids for ``messages``: a continuation of ``prior`` when possible, else a full render."""
        reason = self._refusal(messages, tools, chat_template_kwargs, prior)
        if reason is None and self.history == "template":
            reason = HISTORY_TEMPLATE  # a turn that could continue, rendered whole by configuration
        if reason is None:
            assert prior is not None
            n = len(prior.messages)
            key = _shape_key(messages, n, tools, chat_template_kwargs)
            shape = self._shape(key, messages, n, tools, chat_template_kwargs)
            suffix = self._suffix(shape, messages[n + 1 :], tools, chat_template_kwargs) if shape.ok else None
            history_tokens = len(prior.prompt_ids) + len(prior.response_ids)
            verified: bool | None = None  # whether this turn is checked, decided once (it spends the budget)
            if suffix is None:
                reason = TEMPLATE_REWRITES_HISTORY
            else:
                verified = self._due_for_verify(history_tokens)
                if verified and not self._verify(messages, n, tools, chat_template_kwargs, shape, suffix):
                    shape = self._turn_off(key, dataclasses.replace(shape, ok=False))
                    reason = VERIFY_MISMATCH
                else:
                    ids = prior.prompt_ids + prior.response_ids  # a new list: extended in place below
                    reused = len(ids)
                    glue = self._glue(shape.close, prior.response_ids) + suffix
                    ids.extend(self.tokenizer.encode(glue, add_special_tokens=False))
                    return Rendered(ids, CONTINUED, reused_tokens=reused, verified=verified)
            # history=sampled: the sampled ids stay, whatever the template would now render for them.
            if not shape.after_ok:
                reason = VERIFY_MISMATCH
            elif (after := self._after_reply(messages, n, tools, chat_template_kwargs)) is not None:
                if verified is None:
                    verified = self._due_for_verify(history_tokens)
                if verified and not self._text(messages, tools, chat_template_kwargs, True).endswith(after):
                    self._turn_off(key, dataclasses.replace(shape, after_ok=False))
                    reason = VERIFY_MISMATCH
                else:
                    ids = prior.prompt_ids + prior.response_ids
                    reused = len(ids)
                    glued = self._glue(after, prior.response_ids)
                    ids.extend(self.tokenizer.encode(glued, add_special_tokens=False))
                    return Rendered(ids, CONTINUED_OVER_REWRITE, reused_tokens=reused, verified=verified)
        ids = render_prompt_ids(self.tokenizer, messages, tools, chat_template_kwargs=chat_template_kwargs)
        return Rendered(ids, reason)

    def continues_cheaply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        prior: PriorTurn | None,
    ) -> bool:
        """Whether :meth:`render` would, as things stand, continue ``prior`` from a probed shape with no
        full-render check due: its work is then the new messages' alone. A peek: nothing changes."""
        if self.history == "template" or self._refusal(messages, tools, chat_template_kwargs, prior) is not None:
            return False
        assert prior is not None
        key = _shape_key(messages, len(prior.messages), tools, chat_template_kwargs)
        with self._lock:
            shape = self._shapes.get(key)
        if shape is None or not shape.ok:
            return False
        return not self._due_for_verify(len(prior.prompt_ids) + len(prior.response_ids), spend=False)

    # ------------------------------------------------------------------ decisions
    @staticmethod
    def _refusal(
        messages: list[dict[str, Any]],
        tools: Any,
        kwargs: dict[str, Any] | None,
        prior: PriorTurn | None,
    ) -> str | None:
        if prior is None or not prior.prompt_ids:
            return NO_PRIOR_TURN
        n = len(prior.messages)
        if (
            len(messages) < n + 2
            or messages[n].get("role") != "assistant"
            or any(m.get("role") == "assistant" for m in messages[n + 1 :])
        ):
            return NOT_AN_EXTENSION
        if (tools or None) != (prior.tools or None):
            return TOOLS_CHANGED
        if (kwargs or {}) != (prior.chat_template_kwargs or {}):
            return TEMPLATE_KWARGS_CHANGED
        return None

    def _due_for_verify(self, history_tokens: int, *, spend: bool = True) -> bool:
        """Whether this turn's full-render check is due; ``spend``: this turn is rendered now (its credit is
        added, and spent when the check is due), else only a peek."""
        per_turn = self.verify_tokens_per_turn
        if per_turn <= 0:
            return False
        # The credit is capped, so a long run of short turns cannot bank a burst of checks of long ones; a
        # history longer than the cap is checked whenever the credit is full (one turn in that many).
        cap = _VERIFY_CREDIT_TURNS * per_turn
        needed = min(history_tokens, cap)
        with self._lock:
            credit = min(self._verify_credit + per_turn, cap)
            due = credit >= needed
            if spend:
                self._verify_credit = credit - needed if due else credit
            return due

    # ------------------------------------------------------------------ template work
    def _text(self, messages: list[dict[str, Any]], tools: Any, kwargs: Any, gen: bool) -> str:
        return render_prompt_text(
            self.tokenizer, messages, tools, add_generation_prompt=gen, chat_template_kwargs=kwargs
        )

    def _shape(self, key: tuple[Any, ...], messages: list[dict[str, Any]], n: int, tools: Any, kwargs: Any) -> _Shape:
        with self._lock:
            shape = self._shapes.get(key)
            if shape is not None:
                self._shapes.move_to_end(key)
                return shape
        try:
            shape = self._probe(messages, n, tools, kwargs)
        except TemplateRefused:  # refused on stand-ins: the full render says whether the real messages are
            shape = _Shape(ok=False)
        with self._lock:
            self._shapes[key] = shape
            while len(self._shapes) > _PROBE_CACHE_SIZE:
                self._shapes.popitem(last=False)
        return shape

    def _probe(self, messages: list[dict[str, Any]], n: int, tools: Any, kwargs: Any) -> _Shape:
        """Append-only check on synthetic messages of this shape; learns the assistant closing."""
        head, reply = _synthetic(messages, n)
        new = [dict(m, content=f"V{i}") for i, m in enumerate(messages[n + 1 :])]
        gen_prompt = self._text(head, tools, kwargs, True)
        plain = self._text([*head, {"role": "assistant", "content": "A"}], tools, kwargs, False)
        if not plain.startswith(gen_prompt + "A"):
            return _Shape(ok=False)  # the reply is not rendered as generation prompt + content
        close = plain[len(gen_prompt) + 1 :]
        base = [*head, reply]
        base_text = self._text(base, tools, kwargs, False)
        full = self._text([*base, *new], tools, kwargs, True)
        if not (base_text.startswith(gen_prompt) and base_text.endswith(close) and full.startswith(base_text)):
            return _Shape(ok=False)
        needs_tools = True
        if tools:
            bare_base = self._text(base, None, kwargs, False)
            bare_full = self._text([*base, *new], None, kwargs, True)
            needs_tools = not (
                bare_full.startswith(bare_base) and bare_full[len(bare_base) :] == full[len(base_text) :]
            )
        if not needs_tools:
            base_text = self._text(base, None, kwargs, False)
        return _Shape(ok=True, base=tuple(base), base_text=base_text, close=close, suffix_needs_tools=needs_tools)

    def _suffix(self, shape: _Shape, new: list[dict[str, Any]], tools: Any, kwargs: Any) -> str | None:
        """The template's rendering of ``new`` + generation prompt after the synthetic base; None if the
        template rewrote the base for these contents."""
        try:
            full = self._text([*shape.base, *new], tools if shape.suffix_needs_tools else None, kwargs, True)
        except TemplateRefused:
            return None
        if not full.startswith(shape.base_text):
            return None
        return full[len(shape.base_text) :]

    def _after_reply(self, messages: list[dict[str, Any]], n: int, tools: Any, kwargs: Any) -> str | None:
        """history=sampled over a template that rewrites history: what it writes after the reply, its closing
        whole (engine.reply_tail); None: refused stand-ins."""
        try:
            return after_reply(lambda msgs, gen: self._text(msgs, tools, kwargs, gen), messages, n)
        except TemplateRefused:  # refused on stand-ins: the full render says whether the real messages are
            return None

    def _turn_off(self, key: tuple[Any, ...], shape: _Shape) -> _Shape:
        """Records a shape after a failed full-render check (``ok=False``: the suffix path off, ``after_ok=False``:
        the path over a rewrite off), for the process lifetime."""
        with self._lock:
            self._shapes[key] = shape
        return shape

    def _glue(self, close: str, response_ids: list[int]) -> str:
        """The part of the assistant closing the sampled ids do not already hold (their stop token)."""
        if response_ids:
            last = self.tokenizer.decode([response_ids[-1]], skip_special_tokens=False)
            if last and response_ids[-1] in self.tokenizer.all_special_ids and close.startswith(last):
                return close[len(last) :]
        return close

    def _verify(
        self, messages: list[dict[str, Any]], n: int, tools: Any, kwargs: Any, shape: _Shape, suffix: str
    ) -> bool:
        """Text-level check against the full render of the real messages (see the module docstring)."""
        gen_prompt = self._text(messages[:n], tools, kwargs, True)
        with_reply = self._text(messages[: n + 1], tools, kwargs, False)
        full = self._text(messages, tools, kwargs, True)
        return with_reply.startswith(gen_prompt) and with_reply.endswith(shape.close) and full == with_reply + suffix
