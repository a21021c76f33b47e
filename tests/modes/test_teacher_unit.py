"""Unit tests of the hint-augmented teacher prompt and of teacher-scoring failure handling.

Contract (policy_server.rewards.teacher): the hint goes after the LAST user message's text with the marker of
prompts/templates/teacher_hint_v1.txt; the prompt is rendered with the policy chat template (tools
included) and the response ids are appended as ids; a teacher answer whose ids, log-probs or top-K rows
do not line up with the response ids is a TeacherFailed with a reason, never padded. Faults are injected
with httpx.MockTransport (the only fake used here).
"""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from engine.chat import load_tokenizer, render_prompt_ids
from engine.client import EngineClient, RetryPolicy
from engine.errors import EngineUnavailable
from engine.records import PipelineTurn, Turn
from policy_server.rewards.teacher import (
    TeacherFailed,
    TeacherScorer,
    append_hint,
    build_teacher_prompt_ids,
    load_hint_template,
)

pytestmark = pytest.mark.unit

TPL = load_hint_template()
HINT = "The file is in /tmp, not in the home folder."
MARKER = "[user's hint / instruction]"


def test_template_version_and_apply():
    assert TPL.version.startswith("teacher_hint_v1@") and len(TPL.version) == len("teacher_hint_v1@") + 12
    assert TPL.apply("Find it.", f"  {HINT}\n") == f"Find it.\n\n{MARKER}\n{HINT}"
    # $ and braces in user text are substituted once, never re-expanded
    assert TPL.apply("cost ${hint} {x} $5", "h") == f"cost ${{hint}} {{x}} $5\n\n{MARKER}\nh"


def test_append_hint_targets_last_user_message_and_does_not_mutate():
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "open "}, {"type": "text", "text": "it"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "Error: not found", "tool_call_id": "c1"},
    ]
    before = copy.deepcopy(msgs)
    out = append_hint(msgs, HINT, TPL)
    assert msgs == before
    assert out[3]["content"] == f"open it\n\n{MARKER}\n{HINT}"
    assert [m["content"] for i, m in enumerate(out) if i != 3] == ["sys", "first", "ok", "", "Error: not found"]
    assert out[4]["tool_calls"] == msgs[4]["tool_calls"]


def test_append_hint_without_user_message_adds_one():
    out = append_hint([{"role": "system", "content": "sys"}], HINT, TPL)
    assert out[-1] == {"role": "user", "content": f"{MARKER}\n{HINT}"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def test_teacher_prompt_ids_render_policy_template_with_tools(tokenizer):
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "read the file"}]
    ids = build_teacher_prompt_ids(tokenizer, msgs, tools, HINT, TPL)
    expected = render_prompt_ids(tokenizer, [{"role": "user", "content": f"read the file\n\n{MARKER}\n{HINT}"}], tools)
    assert ids == expected
    text = tokenizer.decode(ids)
    assert "<tools>" in text and HINT in text and text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ fault injection on the teacher engine
RESPONSE = [11, 12, 13]


def _engine_answer(entries, top=None, status=200):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["sampling_params"]["max_new_tokens"] == 0
        assert body["logprob_start_len"] == len(body["input_ids"]) - len(RESPONSE) - 1
        meta = {"input_token_logprobs": entries, "weight_version": "0"}
        if top is not None:
            meta["input_top_logprobs"] = top
        return httpx.Response(status, json={"text": "", "output_ids": [], "meta_info": meta})

    return handler


def _scorer(tokenizer, handler, top_k=0):
    client = EngineClient(
        "http://teacher.invalid",
        transport=httpx.MockTransport(handler),
        retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01, jitter_s=0.0, deadline_s=2.0),
    )
    return TeacherScorer(client, tokenizer, top_k=top_k)


TURN = PipelineTurn(session_id="s", turn_index=0, messages=[{"role": "user", "content": "hi"}], response_ids=RESPONSE)
GOOD = [[None, 5, None], [-0.5, 11, None], [-1.5, 12, None], [-2.5, 13, None]]


async def test_teacher_scores_exact_entries(tokenizer):
    top = [None] + [[[-0.1, 7, None], [-0.2, 8, None]]] * 3
    scores = await _scorer(tokenizer, _engine_answer(GOOD, top), top_k=2).score_turn(TURN, HINT)
    assert scores.logprobs == [-0.5, -1.5, -2.5]
    assert scores.topk is not None
    assert scores.topk.to_json() == {"ids": [[7, 8]] * 3, "logprobs": [[-0.1, -0.2]] * 3}


@pytest.mark.parametrize(
    ("entries", "top", "top_k", "reason"),
    [
        ([[None, 5, None], [-0.5, 11, None], [-1.5, 99, None], [-2.5, 13, None]], None, 0, "teacher_mismatch"),
        ([[None, 5, None], [None, 11, None], [-1.5, 12, None], [-2.5, 13, None]], None, 0, "teacher_mismatch"),
        (GOOD[:3], None, 0, "teacher_mismatch"),  # one log-prob short: never padded
        (GOOD, [None, [[-0.1, 7, None]], None, [[-0.1, 7, None]]], 1, "teacher_mismatch"),  # a null top-k row
        (GOOD, [None] + [[[-0.1, 7, None]]] * 3, 2, "teacher_mismatch"),  # rows narrower than K
    ],
)
async def test_teacher_rejects_misaligned_answers(tokenizer, entries, top, top_k, reason):
    with pytest.raises(TeacherFailed) as info:
        await _scorer(tokenizer, _engine_answer(entries, top), top_k=top_k).score_turn(TURN, HINT)
    assert info.value.reason == reason


async def test_teacher_unavailable_and_rejected(tokenizer):
    calls = []

    def down(request):
        calls.append(1)
        return httpx.Response(503, json={"error": "overloaded"})

    with pytest.raises(EngineUnavailable):  # an outage is not a verdict: the dispatcher retries the turn later
        await _scorer(tokenizer, down).score_turn(TURN, HINT)
    assert len(calls) == 2  # the client retried, then gave up

    def too_long(request):
        return httpx.Response(400, json={"error": "input is longer than the context"})

    with pytest.raises(TeacherFailed) as info:
        await _scorer(tokenizer, too_long).score_turn(TURN, HINT)
    assert info.value.reason == "teacher_rejected" and "context" in info.value.detail


async def test_teacher_bad_input(tokenizer):
    with pytest.raises(TeacherFailed, match="teacher_bad_input"):
        await _scorer(tokenizer, _engine_answer(GOOD)).score_turn(TURN.model_copy(update={"response_ids": []}), HINT)
    with pytest.raises(TeacherFailed, match="teacher_bad_input"):
        await _scorer(tokenizer, _engine_answer(GOOD)).score_turn(TURN, "  ")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_teacher_prompt_keeps_the_rollout_prefix_for_the_teacher_cache(tokenizer):
    """The hint goes at the END of the last user message, so the teacher prompt repeats the rollout prompt up
    to there: a prefix-caching teacher engine (SGLang's radix cache) prefills only the hint and what follows,
    and successive turns of one session share their whole earlier conversation."""
    history = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "rename a.txt to b.txt " * 20},
        {"role": "assistant", "content": "Done: renamed a.txt to b.txt."},
        {"role": "user", "content": "now list the folder"},
    ]
    rollout = render_prompt_ids(tokenizer, history, None)
    teacher = build_teacher_prompt_ids(tokenizer, history, None, HINT, TPL)
    # Everything but the last user message's end-of-turn and the generation prompt is shared.
    tail = len(render_prompt_ids(tokenizer, history, None)) - len(
        tokenizer.encode(
            tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=False).rsplit(
                "now list the folder", 1
            )[0]
            + "now list the folder",
            add_special_tokens=False,
        )
    )
    assert _common_prefix(rollout, teacher) >= len(rollout) - tail - 1
    # The next turn's teacher prompt shares the earlier turn's whole conversation with this one.
    later = [*history, {"role": "assistant", "content": "a.txt b.txt"}, {"role": "user", "content": "thanks"}]
    earlier_conversation = render_prompt_ids(tokenizer, history[:3], None, add_generation_prompt=False)
    shared = _common_prefix(teacher, build_teacher_prompt_ids(tokenizer, later, None, HINT, TPL))
    assert shared >= len(earlier_conversation)


async def test_the_teacher_renders_with_the_turns_own_template_kwargs(tokenizer):
    """A turn sampled with ``chat_template_kwargs`` (here: thinking off) is re-rendered for the teacher with the
    same kwargs, from the stored turn as the dispatcher hands it over: the teacher's prompt is the rollout's
    template plus the hint, never the template's default."""
    stored = Turn.model_validate(
        {"session_id": "s", "turn_index": 0, "created_at": 1.0, "messages": TURN.messages, "response_ids": RESPONSE}
        | {"chat_template_kwargs": {"enable_thinking": False}, "tools": None, "record_only": 1}
    )
    sent: list[list[int]] = []

    def capture(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["input_ids"])
        return _engine_answer(GOOD)(request)

    await _scorer(tokenizer, capture).score_turn(PipelineTurn.of(stored), HINT)
    kwargs_ids = build_teacher_prompt_ids(
        tokenizer, TURN.messages, None, HINT, TPL, chat_template_kwargs={"enable_thinking": False}
    )
    default_ids = build_teacher_prompt_ids(tokenizer, TURN.messages, None, HINT, TPL)
    assert kwargs_ids != default_ids, "the kwargs change this template's render"
    assert sent == [kwargs_ids + RESPONSE]
