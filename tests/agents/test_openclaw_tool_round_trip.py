"""One tool round trip of the real, unmodified OpenClaw agent through the dev stack, with a policy that calls a tool.

The stack's policy is the tool-calling tiny policy (devkit.tiny_tool_model, placed where ``launch/dev.sh start``
keeps its models): it should emit a call of OpenClaw's ``read`` tool when the user's message holds its trigger word.
Asserted: OpenClaw runs the call on its workspace and sends the result as the next request; both requests are
recorded token-exact in one session and the call turn's next state is role-typed ``tool``.

The policy windows its attention (devkit.tiny_tool_model), so its decision rests on the request tail alone and
OpenClaw's 33k-token system prompt and tools cannot drown the trigger word; its logits are scaled after training
(devkit.model_cache.TOOL_POLICY_LOGIT_SCALE), so OpenClaw's temperature-1 sampling takes the call on every run, not
on 97 % of them; the dev engine's decode path is the usual one.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.model_cache import copy_of
from devkit.tiny_tool_model import TOOL_CALL, TRIGGER_WORD
from engine.chat import load_tokenizer, render_prompt_ids
from launch.openclaw import write_config
from policy_server.serving.prompt_size import context_length
from tests.testkit import cached_models
from tests.testkit.openclaw import dev_stack, main_turns, openclaw_binaries, openclaw_turn

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
]

NOTE_TEXT = "Plan for tomorrow: ship the release at noon."


def place_models(models: Path) -> None:
    """The tool-calling tiny policy and the dev stack's usual teacher, where ``dev.sh start`` reuses them."""
    copy_of(cached_models.tool_policy(), models / "policy")
    copy_of(cached_models.long_context_teacher(), models / "teacher")


@pytest.fixture(scope="module")
def tool_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    openclaw_binaries()
    run_dir = tmp_path_factory.mktemp("openclaw-tool-stack")
    place_models(run_dir / "models")
    with dev_stack(run_dir) as endpoints:
        yield endpoints


@pytest.fixture
def short_state_dir() -> Iterator[Path]:
    """OpenClaw's state folder at a short path of its own. The workspace path is part of the runtime line OpenClaw
    appends to the user's message, between the trigger word and the end of the request; the tiny tokenizer spells
    a long pytest path (``/tmp/pytest-of-root/pytest-3/popen-gw1/test_...``) letter by letter, over a hundred tokens
    that the tiny policy, trained on shorter runtime lines, lets outweigh the trigger (measured on the scaled policy: log-odds of the call
    -9 there, +16 at ``/tmp/hs-oc-XXXXXXXX``)."""
    with tempfile.TemporaryDirectory(prefix="hs-oc-", dir="/tmp") as d:
        yield Path(d)


def test_stock_openclaw_runs_the_policys_tool_call(tool_stack: dict, short_state_dir: Path) -> None:
    state = short_state_dir / "openclaw"
    workspace = state / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "NOTE.md").write_text(NOTE_TEXT + "\n")
    window = context_length(tool_stack["policy_model_path"])
    assert window is not None and window >= 32768
    config = write_config(state, tool_stack, workspace=str(workspace), context_window_tokens=window)
    tokenizer = load_tokenizer(tool_stack["policy_model_path"])

    openclaw_turn(state, config, "hs-e2e-tool", f"What is my plan for{TRIGGER_WORD}? It is in NOTE.md.")
    turns = main_turns(tool_stack["data_dir"])
    assert len(turns) == 2, [(t["session_id"], t["turn_index"], t["response"]) for t in turns]
    call_turn, answer_turn = turns
    calls = call_turn["response"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (TOOL_CALL["name"], TOOL_CALL["arguments"])
    ], call_turn["response"]
    assert answer_turn["session_id"] == call_turn["session_id"] and answer_turn["session_decision"] == "continued"
    for turn in (call_turn, answer_turn):
        assert turn["prompt_ids"] == render_prompt_ids(tokenizer, turn["messages"], turn["tools"])
        assert len(turn["response_ids"]) == len(turn["rollout_logprobs"]) > 0
    # the call turn's next state is the tool result OpenClaw produced (its context message ignored)
    assert call_turn["pairing"] == "paired", call_turn["pairing_note"]
    assert [m["role"] for m in call_turn["next_state"]] == ["tool"], call_turn["next_state"]
    resent = [m for m in answer_turn["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
    assert call_turn["next_state"][0]["tool_call_id"] == resent[-1]["tool_calls"][0]["id"]
    assert NOTE_TEXT in json.dumps(call_turn["next_state"][0]["content"])
