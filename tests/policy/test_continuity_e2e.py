"""End-to-end token continuity: client -> policy server -> real sglang-router -> dev engine.

A session's continuing turn is sent to the engine as the previous turn's exact prompt ids, its exact sampled
ids, then only the new messages rendered; the engine's prefix cache then reuses everything up to the new
messages (``usage.prompt_tokens_details.cached_tokens``), written as the template's own full render ends. Under an
append-only template (Qwen2.5's) every continued prompt is also checked against the template's full render
(``--render-verify-tokens-per-turn`` large enough for every turn). The tiny model's own template, Qwen3's, rewrites
history (the last reply gets an empty think block; thinking off opens one the template drops from past replies): its
turns keep the sampled ids too (history=sampled) and are counted apart (``continued_over_rewrite``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.chat import load_tokenizer, render_prompt_ids, render_prompt_text
from policy_server.store import Store
from tests.testkit.chat_templates import TEMPLATES_DIR
from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import admin, chat, client, judged_policy_stack, start_routed_policy, stats
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "rename",
            "parameters": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 12}}},
        },
    }
]


@pytest.fixture(scope="module")
def verifying_policy(
    tiny_model_dir: Path, router: ManagedProcess, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    d = tmp_path_factory.mktemp("policy-continuity")
    extra = ["--render-verify-tokens-per-turn", "1000000000"]
    with start_routed_policy(tiny_model_dir, router, engine, d, extra=extra) as mp:
        yield mp


@pytest.fixture(scope="module")
def append_only_policy(
    tiny_model_dir: Path, router: ManagedProcess, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    """The verifying policy under Qwen2.5's template: Qwen3's markup without thinking, append-only."""
    d = tmp_path_factory.mktemp("policy-append-only")
    template = TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja"
    extra = ["--render-verify-tokens-per-turn", "1000000000", "--chat-template", str(template)]
    with start_routed_policy(tiny_model_dir, router, engine, d, extra=extra) as mp:
        yield mp


def _metric(policy: ManagedProcess, reason: str) -> float:
    text = httpx.get(policy.url + "/metrics", trust_env=False, timeout=10).text
    m = re.search(rf'^hindsight_policy_prompt_renders_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _turn(c: httpx.Client, messages: list[dict], sid: str, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 8, "temperature": 1.0, **extra}
    r = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    ("policy_fixture", "reason"),
    [("verifying_policy", "continued_over_rewrite"), ("append_only_policy", "continued")],
    ids=["qwen3-tiny-default", "qwen25-append-only"],
)
def test_a_session_is_token_continuous_and_hits_the_prefix_cache(request, policy_fixture, reason, tiny_model_dir):
    verifying_policy = request.getfixturevalue(policy_fixture)
    store = Store(verifying_policy.log_path.parent / "data")
    tok = load_tokenizer(str(tiny_model_dir))
    if policy_fixture == "append_only_policy":
        tok.chat_template = (TEMPLATES_DIR / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    messages: list[dict] = [  # a system prompt of its own per case: the engine's prefix cache is shared
        {"role": "system", "content": f"You manage files ({reason})."},
        {"role": "user", "content": "list the report folder"},
    ]
    feedback = ["now rename it", None, "thanks, check the error output", "again please"]
    force = {"type": "function", "function": {"name": "rename"}}
    continued_before = _metric(verifying_policy, reason)
    with client(verifying_policy.url) as c:
        for k in range(5):
            # Turn 1 is a forced tool call (its reply and the tool result travel in the suffix); the tools stay.
            out = _turn(
                c, messages, "cont", seed=k, tools=TOOLS, **({"tool_choice": force, "max_tokens": 96} if k == 1 else {})
            )
            if k:
                prev, cur = store.get_turn("cont", k - 1), store.get_turn("cont", k)
                assert prev is not None and cur is not None
                kept = prev.prompt_ids + prev.response_ids
                assert cur.prompt_ids[: len(kept)] == kept  # the exact ids sent and sampled before
                assert len(cur.prompt_ids) > len(kept)
                assert out["usage"]["prompt_tokens"] == len(cur.prompt_ids)
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(kept) - 1
                # The new messages in the template's own words: what its full render of them ends with.
                added = tok.decode(cur.prompt_ids[len(kept) :], skip_special_tokens=False)
                assert render_prompt_text(tok, cur.messages, TOOLS).endswith(added), added
            if k < 4:
                reply = dict(out["choices"][0]["message"])
                calls = reply.get("tool_calls") or []
                if feedback[k] is None:
                    assert len(calls) == 1
                    nxt = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "renamed"}
                else:
                    nxt = {"role": "user", "content": feedback[k]}
                messages += [reply, nxt]
    assert _metric(verifying_policy, reason) - continued_before == 4
    assert _metric(verifying_policy, "verify_mismatch") == 0
    # The first prompt is the template's full render, as before.
    first = store.get_turn("cont", 0)
    assert first is not None and first.prompt_ids == render_prompt_ids(tok, first.messages, TOOLS)


def test_a_template_that_rewrites_history_keeps_the_sampled_ids(verifying_policy, tiny_model_dir):
    """Thinking off: the generation prompt holds an empty think block the template drops from past replies.
    history=sampled (the default) keeps it and the sampled ids; the template's own render would not."""
    store = Store(verifying_policy.log_path.parent / "data")
    tok = load_tokenizer(str(tiny_model_dir))
    messages: list[dict] = [{"role": "user", "content": "check the docs"}]
    before = _metric(verifying_policy, "continued_over_rewrite")
    with client(verifying_policy.url) as c:
        out = _turn(c, messages, "rewrites", reasoning_effort="none")
        messages += [dict(out["choices"][0]["message"]), {"role": "user", "content": "and the tests"}]
        _turn(c, messages, "rewrites", reasoning_effort="none")
    assert _metric(verifying_policy, "continued_over_rewrite") - before == 1
    first, second = store.get_turn("rewrites", 0), store.get_turn("rewrites", 1)
    assert first is not None and second is not None
    kept = first.prompt_ids + first.response_ids
    assert second.prompt_ids[: len(kept)] == kept
    assert second.prompt_ids != render_prompt_ids(tok, second.messages, chat_template_kwargs={"enable_thinking": False})


def test_lease_returns_merged_trajectories(tiny_model_dir, engine, tmp_path_factory):
    """A judged token-continuous session leased with ``merge=true``: one trajectory holds its turns, each turn's
    response at its offset, its prompt as the prefix before it."""
    with judged_policy_stack(tiny_model_dir, engine.url, tmp_path_factory.mktemp("merge-lease")) as (pol, _judge):
        messages: list[dict] = [{"role": "user", "content": "list the files"}]
        for k in range(4):
            reply = chat(pol.url, "merged", messages, max_tokens=6, done=k == 3)
            messages += [
                {"role": "assistant", "content": reply.get("content") or ""},
                {"role": "user", "content": f"thanks, that worked {k}"},
            ]
        wait_until(lambda: stats(pol.url)["samples"]["ready"] >= 3, timeout_s=60, message=lambda: stats(pol.url))
        with admin(pol.url) as a:
            body = a.get("/v1/samples/lease", params={"max": 16, "merge": "true"}).json()
            plain = {s["sample_id"]: s for s in body["samples"]}
            assert a.post("/v1/samples/ack", json={"lease_id": body["lease_id"]}).status_code == 200
    assert len(plain) == 3
    (traj,) = body["trajectories"]
    assert traj["session_id"] == "merged" and [t["turn_index"] for t in traj["turns"]] == [0, 1, 2]
    for t in traj["turns"]:
        s = plain[t["sample_id"]]
        assert traj["token_ids"][: t["response_start"]] == s["prompt_ids"]
        assert traj["token_ids"][t["response_start"] :][: t["response_len"]] == s["response_ids"]
    assert len(traj["token_ids"]) < sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in plain.values())
