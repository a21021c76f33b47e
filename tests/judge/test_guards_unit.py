"""Unit tests of the deterministic guards (judge_server.guards) on hand-made steps.

Contract: each rule fires on the defect it names and stays silent on a normal step; repeats ignore call ids
but not arguments; ``degenerate`` catches one glyph or one word repeated, never a short normal answer;
``malformed_tool_call`` catches arguments that are not a JSON object, an empty name and a tool not offered;
the strongest action decides (quarantine > abstain > override); ``off`` rules never run; the configuration
parser merges over the defaults and names what it refuses; the version follows the configuration.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.records import GuardHit
from judge_server.guards import (
    DEFAULT_GUARD_ACTIONS,
    GUARD_RULES,
    GuardedStep,
    Guards,
    decisive,
    degenerate,
    guards_version,
    malformed_tool_call,
    parse_guard_actions,
    repeated_tool_call,
    tool_error,
    truncated,
)

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def call(name: str, args: Any, call_id: str = "c1") -> dict[str, Any]:
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def step(
    response: dict[str, Any] | None = None,
    next_state: list[dict[str, Any]] | None = None,
    context: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> GuardedStep:
    return GuardedStep(
        context=context or [{"role": "user", "content": "Who directed Alien?"}],
        response=response if response is not None else {"content": "Ridley Scott directed Alien."},
        next_state=next_state or [{"role": "user", "content": "Thanks."}],
        tools=tools,
    )


# ---------------------------------------------------------------------------- tool_error
@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "ok", "is_error": True},
        {"role": "tool", "content": "ok", "status": "error"},
        {"role": "tool", "content": '{"error": "rate limited"}'},
        {"role": "tool", "content": "Error: no such file"},
        {"role": "tool", "content": "ERROR 42"},
        {"role": "tool", "content": "Exception raised in handler"},
        {"role": "tool", "content": "Traceback (most recent call last):\n  File x"},
        {"role": "tool", "content": [{"type": "text", "text": "error: timeout"}]},
    ],
)
def test_tool_error_fires_on_an_error_result(message: dict[str, Any]) -> None:
    assert tool_error(step(next_state=[message])) is not None


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": '{"result": "Alien (1979)", "error": null}'},
        {"role": "tool", "content": "Exceptional results were reported."},
        {"role": "tool", "content": "Errors are rare in this dataset."},
        {"role": "tool", "content": "no error here"},
        {"role": "user", "content": "Error: you got it wrong"},  # the user's words are not a tool result
    ],
)
def test_tool_error_is_silent_on_a_normal_result(message: dict[str, Any]) -> None:
    assert tool_error(step(next_state=[message])) is None


# ---------------------------------------------------------------------------- repeated_tool_call
def test_repeated_tool_call_ignores_call_ids_but_not_arguments() -> None:
    earlier = {"role": "assistant", "content": None, "tool_calls": [call("search", {"q": "Alien", "n": 1}, "a")]}
    context = [{"role": "user", "content": "Who directed Alien?"}, earlier, {"role": "tool", "content": "..."}]
    # Same call, another id, keys in another order: a repeat.
    same = {"content": None, "tool_calls": [call("search", '{"n": 1, "q": "Alien"}', "b")]}
    assert repeated_tool_call(step(same, context=context)) is not None
    other_args = {"content": None, "tool_calls": [call("search", {"q": "Alien", "n": 2}, "a")]}
    assert repeated_tool_call(step(other_args, context=context)) is None
    other_name = {"content": None, "tool_calls": [call("lookup", {"q": "Alien", "n": 1}, "a")]}
    assert repeated_tool_call(step(other_name, context=context)) is None
    # A call only a user message mentions is no earlier assistant call.
    user_only = [{"role": "user", "content": "search(q=Alien)"}]
    assert repeated_tool_call(step(same, context=user_only)) is None


# ---------------------------------------------------------------------------- truncated
@pytest.mark.parametrize("reason,fires", [("length", True), ("max_tokens", True), ("stop", False), (None, False)])
def test_truncated_reads_the_finish_reason(reason: str | None, fires: bool) -> None:
    response = {"content": "Ridley Scott directed", "finish_reason": reason}
    assert (truncated(step(response)) is not None) is fires


def test_truncated_reads_anthropics_stop_reason() -> None:
    assert truncated(step({"content": "Ridley", "stop_reason": "max_tokens"})) is not None


# ---------------------------------------------------------------------------- degenerate
@pytest.mark.parametrize(
    "response",
    [
        {"content": "!" * 40},
        {"content": "the " * 30},
        {"content": "Answer: " + "ok ok " * 30},  # a short lead-in, then one word repeated
        {"content": ""},
        {"content": "   "},
        {"content": None},
        {"content": "fine", "reasoning_content": "wait " * 40},
    ],
)
def test_degenerate_fires_on_a_repeated_unit_or_an_empty_reply(response: dict[str, Any]) -> None:
    assert degenerate(step(response)) is not None


@pytest.mark.parametrize(
    "response",
    [
        {"content": "<answer>No</answer>"},
        {"content": "No"},
        {"content": "Yes."},
        {"content": "1979"},
        {"content": "Ridley Scott directed Alien (1979); the sequel Aliens was directed by James Cameron."},
        {"content": "ha ha ha"},  # too short to be degenerate
        {"content": None, "tool_calls": [call("search", {"q": "Alien"})]},  # a call alone is a reply
        {"content": "", "reasoning_content": "The user asks who directed Alien; that is Ridley Scott."},
    ],
)
def test_degenerate_is_silent_on_normal_answers(response: dict[str, Any]) -> None:
    assert degenerate(step(response)) is None


def test_degenerate_detail_names_the_unit_and_count() -> None:
    detail = degenerate(step({"content": "!" * 40}))
    assert detail == "one unit repeated 40 times: '!'"


# ---------------------------------------------------------------------------- malformed_tool_call
@pytest.mark.parametrize(
    "tool_call,tools",
    [
        (call("search", "{not json"), TOOLS),
        (call("search", "[1, 2]"), TOOLS),  # JSON, but not an object
        (call("", {"q": "x"}), TOOLS),
        (call("  ", {"q": "x"}), None),
        (call("browse", {"q": "x"}), TOOLS),  # not among the offered tools
        (call("search", {"q": "x"}), []),  # no tool was offered at all
    ],
)
def test_malformed_tool_call_fires(tool_call: dict[str, Any], tools: list[dict[str, Any]] | None) -> None:
    assert malformed_tool_call(step({"content": None, "tool_calls": [tool_call]}, tools=tools)) is not None


@pytest.mark.parametrize(
    "tool_call,tools",
    [
        (call("search", {"q": "Alien"}), TOOLS),
        (call("search", ""), TOOLS),  # empty arguments: no arguments
        (call("browse", {"q": "x"}), None),  # tools unknown: names are not checked
    ],
)
def test_malformed_tool_call_is_silent_on_a_good_call(
    tool_call: dict[str, Any], tools: list[dict[str, Any]] | None
) -> None:
    assert malformed_tool_call(step({"content": None, "tool_calls": [tool_call]}, tools=tools)) is None


# ---------------------------------------------------------------------------- Guards, actions, config
BAD_STEP = step(
    {"content": "!" * 40, "finish_reason": "length"},
    next_state=[{"role": "tool", "content": "Error: boom"}],
)


def test_guards_run_only_enabled_rules_in_rule_order_with_their_actions() -> None:
    hits = Guards({"tool_error": "override"}).run(BAD_STEP)  # over the defaults: truncated stays off
    assert [(h.rule, h.action) for h in hits] == [("tool_error", "override"), ("degenerate", "quarantine")]
    hits = Guards({"tool_error": "abstain", "truncated": "quarantine"}).run(BAD_STEP)
    assert [(h.rule, h.action) for h in hits] == [
        ("tool_error", "abstain"),
        ("truncated", "quarantine"),
        ("degenerate", "quarantine"),
    ]
    assert Guards(dict.fromkeys(GUARD_RULES, "off")).run(BAD_STEP) == []
    assert Guards().run(step()) == []


def test_the_strongest_action_decides_and_the_first_of_equals() -> None:
    override = GuardHit(rule="tool_error", action="override", detail="x")
    abstain = GuardHit(rule="repeated_tool_call", action="abstain", detail="y")
    quarantine = GuardHit(rule="truncated", action="quarantine", detail="z")
    quarantine2 = GuardHit(rule="degenerate", action="quarantine", detail="w")
    assert decisive([]) is None
    assert decisive([override, abstain]) == abstain
    assert decisive([override, quarantine, abstain]) == quarantine
    assert decisive([quarantine, quarantine2]) == quarantine
    assert decisive([override]) == override


def test_parse_guard_actions_merges_over_the_defaults() -> None:
    assert parse_guard_actions(None) == DEFAULT_GUARD_ACTIONS
    parsed = parse_guard_actions(" tool_error=override , degenerate=off,repeated_tool_call")
    assert parsed == {
        **DEFAULT_GUARD_ACTIONS,
        "tool_error": "override",
        "degenerate": "off",
        "repeated_tool_call": "override",  # a bare rule takes its natural action
    }
    assert list(parsed) == list(GUARD_RULES)
    assert parse_guard_actions({"truncated": "abstain"})["truncated"] == "abstain"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("bogus=override", "unknown rule 'bogus'"),
        ("tool_error=punish", "action must be one of override, abstain, quarantine or off, got 'punish'"),
        ("=override", "names no rule"),
        ("tool_error=override,tool_error=off", "tool_error is set twice"),
        ({"degenerate": "maybe"}, "got 'maybe'"),
    ],
)
def test_parse_guard_actions_names_what_it_refuses(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match="guards: .*") as err:
        parse_guard_actions(spec)
    assert message in str(err.value)


def test_guards_refuse_an_unknown_rule_or_action() -> None:
    with pytest.raises(ValueError, match="unknown guard"):
        Guards({"bogus": "override"})
    with pytest.raises(ValueError, match="action must be"):
        Guards({"tool_error": "punish"})


def test_the_version_follows_the_configuration() -> None:
    default = guards_version(parse_guard_actions(None))
    assert default.startswith("guards@") and len(default) == len("guards@") + 12
    assert guards_version(parse_guard_actions("")) == default
    assert guards_version(parse_guard_actions("tool_error=override")) != default
    assert guards_version(parse_guard_actions("degenerate=abstain")) != default
