"""Token-continuous prompts (engine.continuation): exact ids, suffix-only rendering, and every fallback."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from engine import continuation as cont
from engine.chat import load_tokenizer, render_prompt_ids, render_prompt_text
from engine.continuation import ContinuationRenderer, PriorTurn
from tests.testkit.chat_templates import TEMPLATES_DIR

pytestmark = pytest.mark.unit
ALWAYS = 10**9  # a verification budget that covers every turn

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir: Path) -> Any:
    """The tiny tokenizer with its own template, Qwen3's: it rewrites history (the last reply gets an empty think
    block), so its turns continue over the rewrite (every shared template's are: tests/unit/test_template_matrix.py)."""
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tok(qwen3: Any) -> Any:
    """The tiny tokenizer under Qwen2.5's template: Qwen3's markup (ChatML, Hermes tool calls) without thinking,
    append-only, so the tests of the append-only path (``continued``, its checks and its cost) have one."""
    t = copy.copy(qwen3)
    t.chat_template = (TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    return t


def _eos(tok: Any) -> int:
    return int(tok.convert_tokens_to_ids("<|im_end|>"))


def _chars(tok: Any, text: str) -> list[int]:
    """A tokenization of ``text`` no full render would produce (one token per character where it can)."""
    out: list[int] = []
    for ch in text:
        out += tok.encode(ch, add_special_tokens=False)
    return out


def test_continuation_equals_the_full_render_when_the_reply_tokenizes_like_the_template(tok: Any) -> None:
    r = ContinuationRenderer(tok, verify_tokens_per_turn=ALWAYS)
    m = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"}]
    p = render_prompt_ids(tok, m, TOOLS)
    resp = tok.encode(CALL_TEXT, add_special_tokens=False) + [_eos(tok)]
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    new = [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "22C"},
    ]
    out = r.render([*m, reply, *new], TOOLS, None, PriorTurn(m, TOOLS, None, p, resp))
    assert out.reason == cont.CONTINUED and out.verified
    assert out.reused_tokens == len(p) + len(resp)
    assert out.ids == render_prompt_ids(tok, [*m, reply, *new], TOOLS)


def test_sampled_ids_stay_exact_and_only_the_suffix_is_rendered(tok: Any) -> None:
    r = ContinuationRenderer(tok, verify_tokens_per_turn=ALWAYS)
    m = [{"role": "user", "content": "say hello"}]
    p = render_prompt_ids(tok, m)
    resp = _chars(tok, "hello  there") + [_eos(tok)]  # a tokenization the template's render would not give
    msgs = [*m, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "thanks"}]
    out = r.render(msgs, None, None, PriorTurn(m, None, None, p, resp))
    assert out.reason == cont.CONTINUED
    assert out.ids[: len(p) + len(resp)] == p + resp
    suffix = out.ids[len(p) + len(resp) :]
    assert suffix == tok.encode(
        "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert render_prompt_text(tok, msgs).endswith(tok.decode(suffix, skip_special_tokens=False))


def test_a_reply_cut_without_its_stop_token_gets_the_template_closing(tok: Any) -> None:
    r = ContinuationRenderer(tok, verify_tokens_per_turn=ALWAYS)
    m = [{"role": "user", "content": "count"}]
    p = render_prompt_ids(tok, m)
    resp = tok.encode("one two", add_special_tokens=False)  # finish: length, no <|im_end|>
    msgs = [*m, {"role": "assistant", "content": "one two"}, {"role": "user", "content": "go on"}]
    out = r.render(msgs, None, None, PriorTurn(m, None, None, p, resp))
    assert out.reason == cont.CONTINUED
    assert out.ids == render_prompt_ids(tok, msgs)  # the closing <|im_end|> was added once
    # The template's default system message, the user's, the cut reply (closed here), the user's.
    assert out.ids.count(_eos(tok)) == 4


def test_every_turn_of_a_session_continues_the_previous_exactly(tok: Any) -> None:
    r = ContinuationRenderer(tok, verify_tokens_per_turn=ALWAYS)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent"}, {"role": "user", "content": "start"}]
    prior = None
    for i in range(5):
        out = r.render(copy.deepcopy(msgs), TOOLS, None, prior)
        assert out.reason == (cont.CONTINUED if i else cont.NO_PRIOR_TURN)
        if prior is not None:
            assert out.ids[: out.reused_tokens] == prior.prompt_ids + prior.response_ids
        text = f"step {i}"
        resp = _chars(tok, text) + [_eos(tok)]
        prior = PriorTurn(copy.deepcopy(msgs), TOOLS, None, out.ids, resp)
        feedback = (
            {"role": "tool", "tool_call_id": "c1", "content": f"r{i}"}
            if i % 2
            else {"role": "user", "content": f"u{i}"}
        )
        msgs += [{"role": "assistant", "content": text}, feedback]


def test_refusals_fall_back_to_the_full_render(tok: Any) -> None:
    r = ContinuationRenderer(tok, verify_tokens_per_turn=ALWAYS)
    m = [{"role": "user", "content": "hi"}]
    p = render_prompt_ids(tok, m)
    resp = tok.encode("yo", add_special_tokens=False) + [_eos(tok)]
    prior = PriorTurn(m, None, None, p, resp)
    good = [*m, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    cases = [
        (good, None, None, None, cont.NO_PRIOR_TURN),
        ([*m, {"role": "user", "content": "more"}], None, None, prior, cont.NOT_AN_EXTENSION),
        (
            [*good, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
            None,
            None,
            prior,
            cont.NOT_AN_EXTENSION,
        ),
        (good, TOOLS, None, prior, cont.TOOLS_CHANGED),
        (good, None, {"enable_thinking": False}, prior, cont.TEMPLATE_KWARGS_CHANGED),
    ]
    for msgs, tools, kwargs, pr, reason in cases:
        out = r.render(msgs, tools, kwargs, pr)
        assert out.reason == reason and out.reused_tokens == 0
        assert out.ids == render_prompt_ids(tok, msgs, tools, chat_template_kwargs=kwargs)


def test_thinking_off_rewrites_history_in_the_tiny_template(qwen3: Any) -> None:
    # The generation prompt opens an empty <think></think> block that the template drops from past replies.
    tok = qwen3
    r = ContinuationRenderer(tok, verify_tokens_per_turn=0)
    kw = {"enable_thinking": False}
    m = [{"role": "user", "content": "hi"}]
    p = render_prompt_ids(tok, m, chat_template_kwargs=kw)
    resp = tok.encode("yo", add_special_tokens=False) + [_eos(tok)]
    msgs = [*m, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    out = r.render(msgs, None, kw, PriorTurn(m, None, kw, p, resp))
    # history=sampled: the previous prompt (its empty block included) and the sampled ids stay; the new
    # message follows in the template's words.
    assert out.reason == cont.CONTINUED_OVER_REWRITE
    assert out.ids == p + resp + tok.encode(
        "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False
    )
    assert out.ids != render_prompt_ids(tok, msgs, chat_template_kwargs=kw)  # the template's render drops it
    full = ContinuationRenderer(tok, history="template").render(msgs, None, kw, PriorTurn(m, None, kw, p, resp))
    assert (full.reason, full.ids) == (cont.HISTORY_TEMPLATE, render_prompt_ids(tok, msgs, chat_template_kwargs=kw))


# A template of the Qwen3 kind: past replies lose their reasoning once a new user message follows them.
DROPS_PAST_REASONING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user -%}"
    "{{ '<think>' + m.reasoning_content + '</think>' }}"
    "{%- endif -%}"
    "{{ m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def test_a_template_that_drops_past_reasoning_is_detected(tok: Any) -> None:
    t = copy.copy(tok)
    t.chat_template = DROPS_PAST_REASONING
    r = ContinuationRenderer(t, verify_tokens_per_turn=0)
    m = [{"role": "user", "content": "q"}]
    p = render_prompt_ids(t, m)
    resp = tok.encode("<think>hmm</think>call", add_special_tokens=False) + [_eos(tok)]
    reply = {"role": "assistant", "content": "call", "reasoning_content": "hmm"}
    prior = PriorTurn(m, None, None, p, resp)
    user_next = r.render([*m, reply, {"role": "user", "content": "again"}], None, None, prior)
    assert user_next.reason == cont.CONTINUED_OVER_REWRITE  # the reasoning stays in the sampled ids
    assert user_next.ids == p + resp + t.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    tool_next = r.render([*m, reply, {"role": "tool", "content": "42"}], None, None, prior)
    assert tool_next.reason == cont.CONTINUED  # a tool result keeps the reasoning: append-only there


# Append-only on short conversations, but the system line changes once the conversation is long: only a
# check against the full render of the real messages can see it.
REWRITES_WHEN_LONG = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- if loop.first and messages | length > 4 %}{{ ' (long)' }}{% endif %}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def _two_turns(t: Any, tok: Any) -> tuple[list[dict[str, Any]], list[int], list[int], PriorTurn]:
    """A four-message turn rendered with template ``t``, its reply "d", and the next request (reply + user "e"):
    (next messages, the turn's prompt ids, its sampled ids, the PriorTurn the next render continues)."""
    m = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    p = render_prompt_ids(t, m)
    resp = tok.encode("d", add_special_tokens=False) + [_eos(tok)]
    msgs = [*m, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    return msgs, p, resp, PriorTurn(m, None, None, p, resp)


def test_verification_catches_what_the_probe_cannot_and_turns_the_shape_off(tok: Any) -> None:
    t = copy.copy(tok)
    t.chat_template = REWRITES_WHEN_LONG
    msgs, p, resp, prior = _two_turns(t, tok)
    unverified = ContinuationRenderer(t, verify_tokens_per_turn=0).render(msgs, None, None, prior)
    assert unverified.reason == cont.CONTINUED  # the probe's short synthetic conversation does not show it
    r = ContinuationRenderer(t, verify_tokens_per_turn=ALWAYS)
    out = r.render(msgs, None, None, prior)
    # The mismatch is seen; history=sampled keeps the sampled ids and renders the new message after them.
    assert out.reason == cont.CONTINUED_OVER_REWRITE and out.ids == unverified.ids
    r.verify_tokens_per_turn = 0
    assert r.render(msgs, None, None, prior).reason == cont.CONTINUED_OVER_REWRITE  # remembered: shape off


# Rewrites history (the generation prompt opens a think block past replies do not show) and numbers user
# messages: the stand-ins continued_over_rewrite renders the new message after hold fewer of them than the real
# conversation, so only the full render of the real messages shows the number it should carry.
NUMBERS_USERS = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role }}{% if m.role == 'user' %}{{ ' ' ~ loop.index }}{% endif %}"
    "{{ '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif -%}"
)


def test_verification_checks_turns_continued_over_a_rewrite(tok: Any, qwen3: Any) -> None:
    """The same budget checks continued_over_rewrite turns: the full render of the real messages must end with
    what was rendered after the sampled ids. A mismatch is a full render, and that shape stays off."""
    t = copy.copy(tok)
    t.chat_template = NUMBERS_USERS
    msgs, p, resp, prior = _two_turns(t, tok)
    unchecked = ContinuationRenderer(t, verify_tokens_per_turn=0).render(msgs, None, None, prior)
    assert unchecked.reason == cont.CONTINUED_OVER_REWRITE and not unchecked.verified
    added = t.decode(unchecked.ids[len(p) + len(resp) :], skip_special_tokens=False)
    assert "user 4" in added and not render_prompt_text(t, msgs).endswith(added)  # the real one is user 6
    r = ContinuationRenderer(t, verify_tokens_per_turn=ALWAYS)
    out = r.render(msgs, None, None, prior)
    assert (out.reason, out.ids) == (cont.VERIFY_MISMATCH, render_prompt_ids(t, msgs))
    r.verify_tokens_per_turn = 0
    assert r.render(msgs, None, None, prior).reason == cont.VERIFY_MISMATCH  # remembered: shape off
    # Qwen3's own template passes the check (every shared template does: tests/unit/test_template_matrix.py).
    kw = {"enable_thinking": False}
    q = [{"role": "user", "content": "hi"}]
    qp = render_prompt_ids(qwen3, q, chat_template_kwargs=kw)
    qmsgs = [*q, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    qprior = PriorTurn(q, None, kw, qp, qwen3.encode("yo", add_special_tokens=False) + [_eos(qwen3)])
    checked = ContinuationRenderer(qwen3, verify_tokens_per_turn=ALWAYS).render(qmsgs, None, kw, qprior)
    assert checked.reason == cont.CONTINUED_OVER_REWRITE and checked.verified


def test_suffix_cost_does_not_depend_on_history_length(tok: Any) -> None:
    """Counts characters handed to the template: a continued turn renders the same amount at any history."""
    rendered: list[int] = []

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
            rendered.append(sum(len(m.get("content") or "") for m in messages))
            return self.inner.apply_chat_template(messages, **kw)

    counting = Counting(tok)
    r = ContinuationRenderer(counting, verify_tokens_per_turn=0)
    costs = []
    for n_hist in (2, 200):
        m = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 50} for i in range(n_hist)]
        m.append({"role": "user", "content": "last"})
        p = render_prompt_ids(tok, m)
        resp = tok.encode("ok", add_special_tokens=False) + [_eos(tok)]
        msgs = [*m, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
        r.render(msgs, None, None, PriorTurn(m, None, None, p, resp))  # the first one probes the shape
        rendered.clear()
        out = r.render(msgs, None, None, PriorTurn(m, None, None, p, resp))
        assert out.reason == cont.CONTINUED
        costs.append(sum(rendered))
    assert costs[0] == costs[1] < 20


def test_the_verification_budget_checks_a_constant_share_of_history_tokens():
    """Each continued turn earns T tokens of credit; a turn is checked when the credit covers its history:
    every turn of a T-token history, one in 8 of an 8T-token one, so the check's render work per turn does
    not grow with the history. The credit is capped at 64 turns' worth."""
    r = ContinuationRenderer(None, verify_tokens_per_turn=100)
    assert [r._due_for_verify(100) for _ in range(4)] == [True] * 4
    checks = [r._due_for_verify(800) for _ in range(32)]
    assert sum(checks) == 4 and checks[7] and checks[15]
    r = ContinuationRenderer(None, verify_tokens_per_turn=100)
    for _ in range(1000):  # a long run of short turns banks at most the cap
        r._due_for_verify(1)
    assert sum(r._due_for_verify(6400) for _ in range(64)) == 1  # no burst of long checks
    huge = ContinuationRenderer(None, verify_tokens_per_turn=100)
    assert sum(huge._due_for_verify(10**6) for _ in range(128)) == 2  # longer than the cap: one turn in 64
    assert not any(ContinuationRenderer(None, verify_tokens_per_turn=0)._due_for_verify(1) for _ in range(3))


def test_continues_cheaply_peeks_at_the_shape_and_the_budget_without_spending(tok: Any) -> None:
    """True only when render would continue from an already probed shape with no check due; asking never
    spends verification credit, so a check that is due stays due for the render that runs it."""
    r = ContinuationRenderer(tok, verify_tokens_per_turn=20)
    m = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prior = PriorTurn(m, None, None, render_prompt_ids(tok, m), tok.encode("hello", add_special_tokens=False))
    msgs = [*m, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert not r.continues_cheaply(msgs, None, None, None)  # nothing to continue
    assert not r.continues_cheaply(msgs, None, None, prior)  # shape not probed yet
    assert r.render(msgs, None, None, prior).continued
    assert not r.continues_cheaply(msgs[:-1], None, None, prior)  # not an extension
    history = len(prior.prompt_ids) + len(prior.response_ids)
    assert 20 < history < 40  # the credit covers it on some turns, not on others
    dues = []
    for _ in range(6):
        credit = r._verify_credit
        due = r._due_for_verify(history, spend=False)
        assert r.continues_cheaply(msgs, None, None, prior) is (not due)
        assert r._verify_credit == credit  # peeks spend nothing
        out = r.render(msgs, None, None, prior)
        assert out.continued and out.verified is due
        dues.append(due)
    assert set(dues) == {True, False}  # the budget made some turns check and let others through
