"""Real chat templates served end to end: client -> policy server (``--chat-template``) -> dev engine (tiny model).

Contract: with ``--history sampled`` (the default) every continued turn's prompt ids start with the previous
turn's prompt ids + sampled ids, through plain chat with thinking off and a forced tool loop, under Qwen3's
template (which rewrites history); ``--history template`` records exactly the template's render. A template's
own refusal is a 400 ``template_refused`` (Gemma 2 and a system message, Hermes-3's tool-use template
without tools), never a 500; Mistral-Nemo's tool loop runs with its 9-alphanumeric ids, its forced calls in its
own ``[TOOL_CALLS]`` markup. ``/v1/models`` says which history mode, parsers and reasoning switch the server
chose; ``reasoning_effort`` reaches DeepSeek-V3.1's ``thinking`` and gpt-oss's levels as it reaches Qwen3's
``enable_thinking``, and their sessions stay continuous.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.chat import load_tokenizer, render_prompt_ids
from policy_server.store import Store
from tests.testkit.chat_templates import TEMPLATES_DIR, TOOLS
from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import CLIENT_KEY, client, start_policy

pytestmark = pytest.mark.e2e
FORCE = {"type": "function", "function": {"name": "rename"}}


@contextmanager
def _policy(
    tiny_model_dir: Path, engine: ManagedProcess, work: Path, template: str, *extra: str
) -> Iterator[ManagedProcess]:
    args = ["--chat-template", str(TEMPLATES_DIR / template), *extra]
    with start_policy(tiny_model_dir, engine.url, work / "data", work, extra=args) as mp:
        yield mp


def _post(c: httpx.Client, sid: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 1.0, **extra}
    return c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})


def _loop(c: httpx.Client, sid: str, turns: int, *, system: bool = True, **extra: Any) -> list[dict[str, Any]]:
    """A session of ``turns`` turns; a forced call's result (else a user message) follows each reply."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You manage files."}] if system else []
    messages.append({"role": "user", "content": "rename the report"})
    replies = []
    for k in range(turns):
        r = _post(c, sid, messages, **extra)
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]
        replies.append(reply)
        calls = reply.get("tool_calls") or []
        nxt = (
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": f"renamed {k}"}
            if calls
            else {"role": "user", "content": f"and then step {k}"}
        )
        messages += [{k2: v for k2, v in reply.items() if v is not None}, nxt]
    return replies


def _continuous(store: Store, sid: str, turns: int) -> int:
    """How many continued turns start with the previous turn's prompt and sampled ids."""
    kept = 0
    for k in range(1, turns):
        prev, cur = store.get_turn(sid, k - 1), store.get_turn(sid, k)
        assert prev is not None and cur is not None
        ids = prev.prompt_ids + prev.response_ids
        kept += cur.prompt_ids[: len(ids)] == ids
    return kept


def test_qwen3_sampled_history_is_continuous_and_template_history_is_the_render(
    tiny_model_dir: Path, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = "Qwen-Qwen3-0.6B.jinja"
    with _policy(tiny_model_dir, engine, tmp_path_factory.mktemp("qwen3"), name) as pol:
        models = httpx.get(
            pol.url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"}, trust_env=False, timeout=10
        ).json()
        card = models["data"][0]
        assert (card["history"], card["tool_call_parser"], card["reasoning_parser"]) == ("sampled", "qwen25", "qwen3")
        assert card["reasoning_switch"] == "enable_thinking"
        with client(pol.url) as c:
            _loop(c, "think-off", 5, reasoning_effort="none")
            replies = _loop(c, "tools", 5, tools=TOOLS, tool_choice=FORCE, max_tokens=64)
        store = Store(pol.log_path.parent / "data")
        assert _continuous(store, "think-off", 5) == 4
        assert _continuous(store, "tools", 5) == 4
        assert all(r.get("tool_calls") for r in replies)
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = (TEMPLATES_DIR / name).read_text()
    with _policy(tiny_model_dir, engine, tmp_path_factory.mktemp("qwen3-t"), name, "--history", "template") as pol:
        with client(pol.url) as c:
            _loop(c, "think-off", 3, reasoning_effort="none")
        store = Store(pol.log_path.parent / "data")
        for k in range(3):
            turn = store.get_turn("think-off", k)
            assert turn is not None
            kw = {"enable_thinking": False}
            assert turn.prompt_ids == render_prompt_ids(tok, turn.messages, chat_template_kwargs=kw)


def test_template_refusals_are_400s_and_mistral_tool_loops_run(
    tiny_model_dir: Path, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    system = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with _policy(tiny_model_dir, engine, tmp_path_factory.mktemp("gemma"), "google-gemma-2-2b-it.jinja") as pol:
        with client(pol.url) as c:
            r = _post(c, "g", system)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "template_refused" and "System role not supported" in err["message"]
            _loop(c, "g2", 2, system=False)
    hermes = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"
    with _policy(tiny_model_dir, engine, tmp_path_factory.mktemp("hermes3"), hermes) as pol:
        with client(pol.url) as c:
            r = _post(c, "h", [{"role": "user", "content": "u"}])
            assert r.status_code == 400 and r.json()["error"]["code"] == "template_refused", r.text
            _loop(c, "h2", 2, tools=TOOLS, tool_choice=FORCE, max_tokens=64)
    mistral = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    with _policy(tiny_model_dir, engine, tmp_path_factory.mktemp("mistral"), mistral) as pol:
        with client(pol.url) as c:
            replies = _loop(c, "m", 4, tools=TOOLS, tool_choice=FORCE, max_tokens=64)
        store = Store(pol.log_path.parent / "data")
        assert _continuous(store, "m", 4) == 3
        for reply in replies:
            (call,) = reply["tool_calls"]
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
        turn = store.get_turn("m", 0)
        assert turn is not None
        tok = load_tokenizer(str(tiny_model_dir))
        assert tok.decode(turn.response_ids).startswith('[TOOL_CALLS][{"name": "rename", "arguments": ')


@pytest.mark.parametrize(
    ("template", "switch", "effort", "prompt_mark"),
    [
        ("deepseek-ai-DeepSeek-V3.1.jinja", "thinking", "high", "<｜Assistant｜><think>"),
        ("deepseek-ai-DeepSeek-V3.1.jinja", "thinking", "none", "<｜Assistant｜></think>"),
        ("openai-gpt-oss-120b.jinja", "reasoning_effort", "none", "Reasoning: low\n"),
        ("openai-gpt-oss-120b.jinja", "reasoning_effort", "xhigh", "Reasoning: high\n"),
    ],
)
def test_reasoning_effort_reaches_each_familys_own_switch(
    tiny_model_dir: Path,
    engine: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
    template: str,
    switch: str,
    effort: str,
    prompt_mark: str,
) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    with _policy(tiny_model_dir, engine, tmp_path_factory.mktemp("effort"), template) as pol:
        models = httpx.get(
            pol.url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"}, trust_env=False, timeout=10
        ).json()
        assert models["data"][0]["reasoning_switch"] == switch
        with client(pol.url) as c:
            _loop(c, "e", 5, reasoning_effort=effort)
        store = Store(pol.log_path.parent / "data")
        assert _continuous(store, "e", 5) == 4
        turn = store.get_turn("e", 0)
        assert turn is not None and turn.chat_template_kwargs is not None
        prompt = tok.decode(turn.prompt_ids, skip_special_tokens=False)
        assert prompt_mark in prompt and (prompt.endswith(prompt_mark) or switch == "reasoning_effort"), prompt[-200:]
