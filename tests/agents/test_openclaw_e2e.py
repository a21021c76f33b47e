"""The real, unmodified OpenClaw agent (npm ``openclaw``) against the dev stack ``launch/dev.sh start`` brings up.

OpenClaw is configured the way docs/CLIENTS.md tells a user to (``launch/dev.sh openclaw``: one custom provider,
``api: openai-completions``, no header) and runs a two-turn conversation through its gateway (``openclaw gateway
run``, each turn an ``openclaw agent`` call, as a user's channels reach it).
Asserted: every turn is served; each is recorded token-exact (the recorded prompt ids are the policy tokenizer's
render of the recorded messages and tools, one rollout log-prob per sampled id); consecutive turns are paired in
one session with a role-typed next state (OpenClaw's per-request context message ignored); the paired turns are
judged (the stack runs ``JUDGE_BACKEND=openai``: votes through the judge router's /v1/chat/completions); one
trainer step consumes them and updates the engine's weights; a heartbeat the gateway runs meanwhile (it may fire
during the test) is side, never a main turn. Then a second session, of a second agent in the same gateway whose
model entry tells OpenClaw a 40k window, is served by the trained weights and makes OpenClaw run its real
pre-compaction memory flush, which is recorded as side and never trained, then its real compaction (compaction
mode ``default``: the tiny policy's summary would fail the safeguard mode's quality guard): the request after it,
under the next ``prompt_cache_key``, starts the conversation's next session (``compacted``) and pairs the turn
before the compaction with its new message. (Embedded turns, ``openclaw
agent --local``, are tests/agents/test_openclaw_tool_round_trip.py's.)

Node 24 and OpenClaw come from tests/agents/install_openclaw.sh (.ci/run runs it, cached under
~/.cache/hindsight/openclaw). Without them the test is skipped with the reason, and fails in CI.
Each OpenClaw turn sends about 32k prompt tokens (its system prompt and 12 tools), about 5 s of prefill on the CPU
stack, and the gateway boots OpenClaw's runtime once (10-20 s): the test takes about 2 minutes alone and up to 5 on
a loaded 2-core machine; its timeouts are generous for that reason, never assertions.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.chat import load_tokenizer, render_prompt_ids
from launch.openclaw import PROVIDER_ID, write_config
from policy_server.serving.prompt_size import context_length
from tests.testkit.openclaw import dev_stack, main_turns, openclaw_binaries, openclaw_gateway, openclaw_turn
from tests.testkit.procs import free_port
from tests.testkit.trainer_cli import run_trainer_cli
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]

SESSION = "hs-e2e-1"
# The random policy always writes to its limit: each reply token is a decode step over a 32k-token context. What is
# tested does not depend on reply length, so replies are kept short (the config's maxTokens, which OpenClaw sends).
REPLY_TOKENS = 16
SMALL_WINDOW_TOKENS = 40960


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The dev stack as ``JUDGE_BACKEND=openai launch/dev.sh start`` makes it: its judge votes through the judge
    router's OpenAI-compatible ``/v1/chat/completions`` (the other dev-stack tests run the default backend, this
    one's judged turn covers that launch path)."""
    openclaw_binaries()
    with dev_stack(tmp_path_factory.mktemp("openclaw-stack"), JUDGE_BACKEND="openai") as endpoints:
        yield endpoints


def test_stock_openclaw_sessions_side_turns_judging_training(stack: dict, tmp_path: Path) -> None:
    admin = httpx.Client(
        base_url=stack["policy_url"],
        headers={"Authorization": f"Bearer {stack['admin_api_key']}"},
        timeout=60,
        trust_env=False,
    )
    state = tmp_path / "openclaw"
    window = context_length(stack["policy_model_path"])
    assert window is not None and window >= 32768  # the dev models hold a real agent's prompt
    config = write_config(
        state,
        stack,
        workspace=str(state / "workspace"),
        context_window_tokens=window,
        gateway_port=free_port(),
        gateway_token=secrets.token_hex(16),
        max_reply_tokens=REPLY_TOKENS,
    )
    add_small_window_agent(config, state / "workspace-small", SMALL_WINDOW_TOKENS)
    tokenizer = load_tokenizer(stack["policy_model_path"])
    with openclaw_gateway(state, config):
        main_session(stack, admin, state, config, tokenizer)
        before = len(main_turns(stack["data_dir"]))
        # OpenClaw's real pre-compaction memory flush: told a 40k window, a second turn of a 32k-token session is
        # near its compaction point, so OpenClaw first runs the flush (and then its compaction's summary call).
        # Both are served and recorded as side; neither becomes a main turn.
        openclaw_turn(state, config, "hs-e2e-flush", "Hello again.", local=False, agent="small")
        after_training = main_turns(stack["data_dir"])[before]
        assert after_training["session_id"].startswith("hs-e2e-flush")
        assert after_training["weight_version"] == "1"  # OpenClaw's next turn is served by the trained weights
        openclaw_turn(state, config, "hs-e2e-flush", "Remember that my name is Ada.", local=False, agent="small")
    side = admin.get("/v1/side_turns").json()["side_turns"]
    rules = {s["rule"] for s in side}
    assert "openclaw_memory_flush" in rules, [(s["rule"], s["session_id"]) for s in side]
    flush = next(s for s in side if s["rule"] == "openclaw_memory_flush")
    assert flush["session_id"].startswith("hs-e2e-flush") and flush["record"]["response_ids"]
    assert "Pre-compaction memory flush." in json.dumps(flush["record"]["messages"])
    flushed = [
        t
        for t in main_turns(stack["data_dir"])[before:]
        if "Pre-compaction memory flush" in json.dumps(t["messages"][-1:])
    ]
    assert flushed == []  # never a main (trained) turn
    assert_paired_across_the_compaction(stack, rules)
    stats = admin.get("/v1/samples/stats").json()
    assert stats["side_turns"]["openclaw_memory_flush"] >= 1
    # What the gateway runs on its own (its heartbeat, when one fires during the test) is side, never main.
    others = [(t["session_id"], t["messages"][-2:]) for t in main_turns(stack["data_dir"])]
    assert all(sid.startswith(("hs-e2e-1", "hs-e2e-flush")) for sid, _ in others), others


def assert_paired_across_the_compaction(stack: dict, side_rules: set[str]) -> None:
    """OpenClaw compacted the small-window session before its second turn (its summary call is side) and sent that
    turn under the next ``prompt_cache_key`` (``hs-e2e-flush:1``): its system prompt, the summary (the first turn's
    message summarised as a "split turn"), the first turn's reply, the new message. That request starts the
    conversation's next session (``compacted``), and the first turn is paired with the new message."""
    assert "openclaw_compaction_summary" in side_rules, side_rules
    turns = [t for t in main_turns(stack["data_dir"]) if t["session_id"].startswith("hs-e2e-flush")]
    shape = [
        (t["session_id"], t["turn_index"], t["session_decision"], t["pairing"], t["pairing_note"]) for t in turns
    ] + [[(m["role"], json.dumps(m.get("content"))[:160]) for m in t["messages"]] for t in turns[-1:]]
    assert len(turns) == 2, shape
    before, after = turns
    assert after["session_decision"] == "compacted" and after["session_id"] != before["session_id"], shape
    assert "compacted into the following summary" in json.dumps(after["messages"]), shape
    assert before["pairing"] == "paired" and after["session_id"] in before["pairing_note"], shape
    assert [m["role"] for m in before["next_state"]] == ["user"], shape
    assert "Remember that my name is Ada" in before["next_state"][0]["content"], shape


def add_small_window_agent(config: Path, workspace: Path, window_tokens: int) -> None:
    """A second agent, ``small``, in the gateway's config: the same policy through a provider entry that tells
    OpenClaw a ``window_tokens`` context (``<provider>-small``), its own workspace. One gateway then runs both
    sessions (OpenClaw boots its runtime once; an embedded turn boots it each time)."""
    cfg = json.loads(config.read_text())
    providers = cfg["models"]["providers"]
    small = copy.deepcopy(providers[PROVIDER_ID])
    small["models"][0]["contextWindow"] = window_tokens
    providers[f"{PROVIDER_ID}-small"] = small
    model = f"{PROVIDER_ID}-small/{small['models'][0]['id']}"
    cfg["agents"]["entries"] = {"main": {}, "small": {"model": model, "workspace": str(workspace)}}
    cfg["agents"]["ownership"] = "explicit"  # OpenClaw's rule for a roster of more than one agent
    # The tiny random policy's summary has none of the safeguard mode's required headings: its quality guard would
    # refuse every compaction and keep the history. The default mode stores what the model wrote (the main agent
    # never nears its window, so this changes only the small one's sessions).
    cfg["agents"]["defaults"]["compaction"] = {"mode": "default", "qualityGuard": {"enabled": False}}
    config.write_text(json.dumps(cfg, indent=2) + "\n")


def main_session(stack: dict, admin: httpx.Client, state: Path, config: Path, tokenizer: Any) -> None:
    """Two turns of one session through the gateway, the first judged and trained on (the weights it pushes serve
    the gateway's next turn, the memory-flush session's first)."""
    openclaw_turn(state, config, SESSION, "Hello! Please list what you can do.", local=False, agent="main")
    turns = main_turns(stack["data_dir"])
    assert len(turns) == 1
    first = turns[0]
    assert first["session_rule"] == "prompt_cache_key" and first["session_decision"] == "started"
    assert len(first["tools"] or []) >= 1 and len(first["prompt_ids"]) > 16000
    # token-exact: the recorded prompt is the policy tokenizer's render of the recorded request
    assert first["prompt_ids"] == render_prompt_ids(tokenizer, first["messages"], first["tools"])
    assert len(first["response_ids"]) == len(first["rollout_logprobs"]) > 0

    openclaw_turn(state, config, SESSION, "Thanks. Now tell me the time.", local=False, agent="main")
    turns = main_turns(stack["data_dir"])
    assert len(turns) == 2, [(t["session_id"], t["turn_index"], t["session_decision"]) for t in turns]
    t0 = turns[0]
    assert turns[1]["session_id"] == first["session_id"] and turns[1]["session_decision"] == "continued"
    assert t0["pairing"] == "paired" and [m["role"] for m in t0["next_state"]] == ["user"], t0["pairing_note"]
    assert "tell me the time" in t0["next_state"][0]["content"]

    # the paired turn is judged; one trainer step consumes it and loads new weights into the engine
    def ready() -> list[dict] | None:
        rows = admin.get("/v1/samples", params={"session_id": first["session_id"]}).json()["samples"]
        return rows if rows and rows[0]["status"] == "ready" else None

    rows = wait_until(ready, timeout_s=900, interval_s=2, message="turn 0 was not judged in time")
    assert rows[0]["sample"]["prm"]["status"] in ("ok", "tie", "no_valid_votes")
    # judged by the openai backend through the judge router, never its /generate
    assert stack["judge_backend"] == "openai"
    judge_log = (Path(stack["log_dir"]) / "judge.log").read_text()
    assert "/v1/chat/completions" in judge_log and "/generate" not in judge_log
    # The tiny judge often ties (reward 0: nothing to learn, and a batch without a gradient is, correctly, no
    # step). The user's thumbs-up (explicit feedback, override policy) makes the turn's reward +1.
    fb = httpx.post(
        stack["policy_url"] + "/v1/feedback",
        json={"session_id": first["session_id"], "turn_index": 0, "value": "up"},
        headers={"Authorization": f"Bearer {stack['api_key']}"},
        timeout=60,
        trust_env=False,
    )
    assert fb.status_code == 200 and fb.json()["state"] == "applied", fb.text
    ckpt = Path(stack["checkpoint_dir"])
    train = run_trainer_cli(
        [
            "--policy-url",
            stack["policy_url"],
            "--model-path",
            stack["policy_model_path"],
            "--out-dir",
            str(ckpt),
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--min-batch",
            "1",
            "--lease-wait-s",
            "30",
            # One sample: against a running mean that starts at its own reward its advantage is 0, and a batch
            # without a gradient is no step; with no baseline the judged +-1 is the advantage.
            "--baseline",
            "none",
            # One pass over the batch: what is under test is the loop (lease, step, checkpoint, weight push), and
            # each pass over a 34k-token turn is a forward and backward of about 15 CPU-seconds.
            "--ppo-epochs",
            "1",
            "--no-progress",
        ],
        env={"HINDSIGHT_TRAIN_ADMIN_API_KEY": stack["admin_api_key"]},
        timeout_s=600,
    )
    assert train.returncode == 0, train.output[-6000:]
    consumed = admin.get("/v1/samples", params={"session_id": first["session_id"]}).json()["samples"]
    assert consumed[0]["status"] == "consumed"
    version = admin.get("/v1/samples/stats").json()["weight_version"]
    assert version == "1"
