"""Pure pieces of the hostile-input defences, with hand-derived cases: JSON depth and surrogate checks
(engine.http_guard), the prompt-length floor (policy_server.serving.generation), the admin-key rule and its
startup refusal (policy_server.settings/auth), the session-lock cleanup (policy_server.serving.sessions), the
runtime-settings table and file modes of the store (policy_server.store.sqlite), and the mode of a spawned
server's log file (engine.procs.spawn: 0600 whatever the umask, an older world-readable log narrowed too)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys

import pytest
from starlette.requests import Request

from engine.http_guard import BadJSON, check_json_value, parse_json_body
from engine.records import ModeSnapshot, TurnRecord
from policy_server.api.auth import is_admin, require_admin
from policy_server.errors import Unauthorized
from policy_server.serving.prompt_size import prompt_token_floor
from policy_server.serving.sessions import SessionTracker
from policy_server.settings import PolicySettings
from policy_server.store import Store
from tests.testkit.procs import spawn

pytestmark = pytest.mark.unit


def _nest(depth: int) -> object:
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize(
    "value,max_depth,ok",
    [
        (_nest(3), 3, True),  # [[[1]]]: three containers
        (_nest(4), 3, False),
        ({"a": {"b": "c"}}, 2, True),
        ({"a": {"b": {}}}, 2, False),  # an empty container still counts as a level
        ("\ud800", 8, False),  # unpaired high surrogate
        ({"\udc00": 1}, 8, False),  # in a key
        ("caf\u00e9 \U0001f600", 8, True),
    ],
)
def test_check_json_value(value, max_depth, ok):
    if ok:
        check_json_value(value, max_depth)
    else:
        with pytest.raises(BadJSON):
            check_json_value(value, max_depth)


def test_parse_json_body_refuses_without_echo():
    with pytest.raises(BadJSON, match="nested deeper than 64"):
        parse_json_body(b"[" * 100_000, max_depth=64)
    with pytest.raises(BadJSON) as info:
        parse_json_body(b'{"x": "SECRET', max_depth=64)
    assert "SECRET" not in str(info.value)
    with pytest.raises(BadJSON, match="surrogate"):
        parse_json_body(b'{"x": "\\ud800"}', max_depth=64)
    assert parse_json_body(b'{"x": "\\ud83d\\ude00"}', max_depth=64) == {"x": "\U0001f600"}  # a valid pair


def test_prompt_token_floor():
    msgs = [
        {"role": "user", "content": "a" * 100},
        {"role": "user", "content": [{"type": "text", "text": "b" * 50}]},
        {"role": "assistant", "content": None},
    ]
    assert prompt_token_floor(msgs, 10) == 3 + 150 // 10
    assert prompt_token_floor(msgs, 1000) == 3


def _settings(**kw) -> PolicySettings:
    return PolicySettings(model_path="m", engine_url="http://127.0.0.1:1", **kw)


def _request(token: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b""})


def test_admin_routes_never_accept_the_client_key():
    with pytest.raises(ValueError, match="admin_api_key"):
        _settings(api_key="client")
    s = _settings(api_key="client", admin_api_key="admin")
    with pytest.raises(Unauthorized):
        require_admin(_request("client"), s)
    require_admin(_request("admin"), s)
    assert not is_admin(_request(None), s) and is_admin(_request("admin"), s)
    opted = _settings(api_key="client", allow_client_key_for_admin=True)  # the explicit opt-out
    require_admin(_request("client"), opted)
    assert is_admin(_request(None), _settings())  # no key at all: loopback dev, open


def test_session_lock_is_dropped_when_the_session_ends(tmp_path):
    store = Store(tmp_path)
    tracker = SessionTracker(store, idle_timeout_s=60)
    rec = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": None,
        "prompt_ids": [1],
        "response_ids": [2],
        "rollout_logprobs": [-0.1],
        "response": {"content": "x"},
        "weight_version": "v0",
        "weight_versions": ["v0"],
        "sampling_params": {},
    }

    async def run() -> None:
        await tracker.on_main_turn("s1", TurnRecord.model_validate(rec), done=False)
        assert "s1" in tracker._locks
        await tracker.on_main_turn("s1", TurnRecord.model_validate(rec), done=True)
        assert "s1" not in tracker._locks
        await tracker.on_request("s2", [{"role": "user", "content": "hi"}], main=False, done=True)
        assert "s2" not in tracker._locks

    asyncio.run(run())
    store.close()


def test_store_runtime_settings_and_private_files(tmp_path):
    data = tmp_path / "data"
    st = Store(data)
    assert st.get_runtime("mode", ModeSnapshot) is None
    st.set_runtime("mode", ModeSnapshot(mode="opd", w_rl=1.0, w_opd=0.5))
    st.set_runtime("mode", ModeSnapshot(mode="combine", w_rl=1.0, w_opd=0.5))
    st.close()
    st = Store(data)
    assert st.get_runtime("mode", ModeSnapshot) == ModeSnapshot(mode="combine", w_rl=1.0, w_opd=0.5)
    st.close()
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for f in data.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, f


def test_spawned_process_log_is_private_whatever_the_umask(tmp_path):
    old_log = tmp_path / "older.log"
    old_log.write_text("an earlier run\n")
    old_log.chmod(0o644)
    old_umask = os.umask(0o022)
    try:
        fresh = spawn("fresh", [sys.executable, "-c", "print('first line')"], url="", log_dir=tmp_path / "logs")
        older = spawn("older", [sys.executable, "-c", "print('appended')"], url="", log_dir=tmp_path)
    finally:
        os.umask(old_umask)
    assert fresh.proc.wait(timeout=30) == 0 and older.proc.wait(timeout=30) == 0
    assert stat.S_IMODE(fresh.log_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(older.log_path.stat().st_mode) == 0o600
    assert fresh.log_path.read_text() == "first line\n"
    assert older.log_path.read_text() == "an earlier run\nappended\n"  # appended, not truncated


def test_unexpected_errors_answer_one_500_and_rate_limit_their_tracebacks(caplog):
    """A route bug is one 500 naming only the exception type (never its text, which may quote the input),
    and one log record; past ``tracebacks_per_min`` in a minute the records carry no traceback."""
    import logging

    from engine.http_guard import UnexpectedErrorMiddleware

    async def broken(scope, receive, send):
        raise ValueError("secret user text")

    log = logging.getLogger("test.guard")
    mw = UnexpectedErrorMiddleware(
        broken, error_body=lambda status, msg: {"error": {"message": msg}}, logger=log, tracebacks_per_min=3
    )

    async def one() -> list[dict]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        await mw({"type": "http", "method": "POST", "path": "/x"}, None, send)
        return sent

    with caplog.at_level(logging.ERROR, logger="test.guard"):
        answers = [asyncio.run(one()) for _ in range(5)]
    for sent in answers:
        assert sent[0]["status"] == 500
        body = b"".join(m.get("body", b"") for m in sent[1:])
        assert b"ValueError" in body and b"secret" not in body
    records = [r for r in caplog.records if r.name == "test.guard"]
    assert len(records) == 5  # one record per error
    assert [r.exc_info is not None for r in records] == [True, True, True, False, False]
    assert all("secret" not in r.getMessage() for r in records[3:])


def test_prompt_token_floor_counts_tools_and_history_calls():
    big = "d" * 7000
    tools = [{"type": "function", "function": {"name": "f" * 20, "description": big, "parameters": {"type": "object"}}}]
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "g", "arguments": "x" * 99}}]}]
    # strings of the tool: type, function, name, description, parameters, type (keys) + values
    tool_chars = len("type") * 2 + len("function") * 2 + len("name") + 20 + len("description") + 7000
    tool_chars += len("parameters") + len("object")
    assert prompt_token_floor(msgs, 10, tools) == 1 + (1 + 99 + tool_chars) // 10
    assert prompt_token_floor(msgs, 10) == 1 + 100 // 10


class _SlowTokenizer:
    """A tokenizer double whose render blocks until released: shows where the render runs and how many at once."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.peak = 0

    def get_vocab(self) -> dict[str, int]:
        return {"abcd": 0, "a": 1}

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True, **kw) -> str:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        self.release.wait(10)
        with self.lock:
            self.running -= 1
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * len(text)


def _generator(tok, **kw):
    from policy_server.serving.generation import Generator

    return Generator(engine=None, tokenizer=tok, gate=None, **kw)  # type: ignore[arg-type]


def test_long_renders_run_off_the_event_loop_with_bounded_concurrency():
    tok = _SlowTokenizer()
    gen = _generator(tok, max_prompt_tokens=1_000_000, render_concurrency=2)
    long_msgs = [{"role": "user", "content": "x" * 5000}]

    async def main() -> list[list[int]]:
        renders = [asyncio.ensure_future(gen.render(long_msgs, None)) for _ in range(5)]
        while tok.running < 2:  # noqa: ASYNC110  # the loop keeps turning while the renders block their threads
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert tok.running == 2 and not any(r.done() for r in renders)  # the other three wait for a slot
        tok.release.set()
        return await asyncio.gather(*renders)

    results = asyncio.run(main())
    assert tok.peak == 2 and all(len(r.ids) == 5000 for r in results)


def test_render_refuses_by_the_cheap_bound_then_by_the_exact_count():
    from policy_server.errors import InvalidRequest

    tok = _SlowTokenizer()
    tok.release.set()
    gen = _generator(tok, max_prompt_tokens=3000)  # longest vocab entry: 4 characters
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 20_000}}]
    with pytest.raises(InvalidRequest) as cheap:
        asyncio.run(gen.render([{"role": "user", "content": "hi"}], tools))
    assert cheap.value.code == "context_length_exceeded" and "at least" in cheap.value.message
    assert tok.peak == 0  # refused before any render
    with pytest.raises(InvalidRequest) as exact:  # 4000 chars: floor 1001 < 3000, but 4000 tokens exactly
        asyncio.run(gen.render([{"role": "user", "content": "x" * 4000}], None))
    assert exact.value.code == "context_length_exceeded" and "has 4000 tokens" in exact.value.message
    assert len(asyncio.run(gen.render([{"role": "user", "content": "x" * 2999}], None)).ids) == 2999


# --- Forced calls never vanish: the call grammar's strings cannot spell markup, and calls are parsed by
# their structure (engine.chat, policy_server.serving.tool_choice).
_WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}, "k": {"type": "object"}}},
        },
    }
]


def _call_text(args: str) -> str:
    return '<tool_call>\n{"name": "f", "arguments": ' + args + "}\n</tool_call>"


@pytest.mark.parametrize("inside", ["</tool_call>", "</think>", "<think>", "<tool_call>", "<|im_end|>"])
def test_forced_call_grammar_strings_exclude_markup(inside):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from policy_server.serving.tool_choice import forced_tool_grammar

    grammar = xgr.Grammar.from_ebnf(forced_tool_grammar(_WEATHER, "required"))
    value = json.dumps("a" + inside + "b")
    assert not _is_grammar_accept_string(grammar, _call_text('{"x": ' + value + "}"))
    assert not _is_grammar_accept_string(grammar, _call_text('{"k": {' + value + ": 1}}"))  # keys too
    escaped = value.replace("<", "\\u003c")  # still reachable, as the JSON escape
    assert _is_grammar_accept_string(grammar, _call_text('{"x": ' + escaped + "}"))


@pytest.mark.parametrize("inside", ["</tool_call>", "</think>", "</tool_call>\n</think>"])
def test_calls_are_parsed_by_structure_not_by_the_first_closing_tag(inside):
    from engine.chat import DEFAULT_TOOL_PARSER, parse_assistant_output

    args = {"x": "a" + inside + "b"}
    text = _call_text(json.dumps(args))
    for reasoning_parser in (None, parse_assistant_output.__kwdefaults__["reasoning_parser"]):
        parsed = parse_assistant_output(text, reasoning_parser=reasoning_parser, tool_parser=DEFAULT_TOOL_PARSER)
        assert parsed.reasoning_content is None and parsed.content == ""
        [call] = parsed.tool_calls
        assert json.loads(call["function"]["arguments"]) == args
    # with reasoning opened by the prompt (no <think> in the reply): the reasoning ends before the call
    parsed = parse_assistant_output("plan</think>\n" + text, opened=True)
    assert parsed.reasoning_content == "plan" and len(parsed.tool_calls) == 1


def test_a_block_that_is_not_a_call_stays_content_and_later_calls_parse():
    from engine.chat import parse_assistant_output

    text = "<tool_call>{not json}</tool_call> then " + _call_text('{"x": "y"}')
    parsed = parse_assistant_output(text)
    assert parsed.content == "<tool_call>{not json}</tool_call> then"
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f"]
    cut = _call_text('{"x": "y"}')[:-3]  # closing tag cut by max_tokens: no call, the text stays
    assert parse_assistant_output(cut).tool_calls == [] and parse_assistant_output(cut).content == cut


def test_forced_call_is_sent_without_stop_sequences():
    from policy_server.api.openai_fields import ChatExtras, apply_constraints

    sp = {"max_new_tokens": 8, "stop": ["a", "</tool_call>"]}
    assert apply_constraints(ChatExtras(), sp, _WEATHER, "required") is True
    assert "ebnf" in sp and "stop" not in sp
    sp = {"max_new_tokens": 8, "stop": ["a"]}
    assert apply_constraints(ChatExtras(), sp, _WEATHER, "auto") is False and sp["stop"] == ["a"]


@pytest.mark.parametrize(
    "messages,tools",
    [
        ([{"role": "user", "content": [{"type": "text", "text": "x" * 5000}]}], None),
        (
            [{"role": "user", "content": "hi"}],
            [{"type": "function", "function": {"name": "f", "description": "d" * 5000}}],
        ),
    ],
    ids=["one-long-text-part", "one-long-tool"],
)
def test_a_long_part_or_tool_is_rendered_off_the_loop(messages, tools, monkeypatch):
    import threading

    from engine import continuation

    tok = _SlowTokenizer()
    tok.release.set()
    gen = _generator(tok)
    where: list[str] = []

    def spy(*args, **kw):
        where.append(threading.current_thread().name)
        return [1]

    monkeypatch.setattr(continuation, "render_prompt_ids", spy)  # the renderer's full render
    asyncio.run(gen.render(messages, tools))
    assert where and where[0] != threading.main_thread().name
