"""Service tests of the guards in the judge: the app in-process (ASGI) with the rules backend.

Contract (docs/CONTRACTS.md "Judge service", judge_server.guard_verdicts): the guards run on every request
beside the votes; the answer lists every enabled rule that fired (``guards``) and the PRM verdict records
them. ``override`` -> score -1, status ok, reason naming the rule, votes kept; ``abstain`` -> score null,
status abstained; ``quarantine`` -> score null, status quarantined, and the hint is not accepted (status
quarantined). ``truncated`` reads the response's ``finish_reason``, ``malformed_tool_call`` the request's
``tools``. ``/ready`` lists the guard configuration; ``prompt_versions.guards`` changes with it; the
configuration is ``--guards`` / ``HINDSIGHT_JUDGE_GUARDS`` and refuses an unknown rule or action at startup;
``hindsight_judge_guard_hits_total{rule,action}`` counts the hits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.cli_settings import parse_settings
from judge_server.app import create_app
from judge_server.settings import JudgeSettings

pytestmark = pytest.mark.unit

THANKS = [{"role": "user", "content": "Thanks, that worked."}]
REQ: dict[str, Any] = {
    "context": [{"role": "user", "content": "Who directed Alien?"}],
    "response": {"content": "Ridley Scott directed Alien (1979)."},
    "next_state": THANKS,
    "tasks": ["prm"],
}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def sample_value(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples ``name`` in ``text`` whose labels include ``labels``."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@asynccontextmanager
async def rules_judge(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(JudgeSettings(backend="rules", m=3, **overrides))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://judge") as c:
            yield c


async def judge(body: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    async with rules_judge(**overrides) as c:
        r = await c.post("/v1/judge", json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


async def test_no_hit_leaves_the_votes_alone_and_lists_no_guard() -> None:
    body = await judge(REQ)
    assert body["guards"] == [] and body["prm"]["guards"] == []
    assert (body["prm"]["score"], body["prm"]["status"], body["prm"]["votes"]) == (1, "ok", [1, 1, 1])


async def test_tool_error_override_scores_minus_one_and_keeps_the_votes() -> None:
    # The user is pleased (the rules backend votes +1), but the tool result is marked as an error.
    next_state = [{"role": "tool", "content": "no results", "is_error": True}, *THANKS]
    body = await judge({**REQ, "next_state": next_state}, guards="tool_error=override")
    hit = {"rule": "tool_error", "action": "override", "detail": "tool result marked as an error"}
    assert body["guards"] == [hit] and body["prm"]["guards"] == [hit]
    prm = body["prm"]
    assert (prm["score"], prm["status"], prm["votes"]) == (-1, "ok", [1, 1, 1])
    assert prm["reason"] == "guard tool_error: tool result marked as an error"
    # Off by default (its measured -1 precision is below the bar): the votes decide.
    assert (await judge({**REQ, "next_state": next_state}))["prm"]["score"] == 1


async def test_a_degenerate_reply_is_quarantined_by_default_in_every_task() -> None:
    async with rules_judge() as c:
        r = await c.post("/v1/judge", json={**REQ, "response": {"content": "!" * 64}, "tasks": ["prm", "hint"]})
        metrics = (await c.get("/metrics")).text
    body = r.json()
    assert [g["rule"] for g in body["guards"]] == ["degenerate"]
    prm, hint = body["prm"], body["hint"]
    assert (prm["score"], prm["status"], prm["confidence"], prm["votes"]) == (None, "quarantined", 0.0, [1, 1, 1])
    assert prm["reason"].startswith("guard degenerate: one unit repeated 64 times")
    assert (hint["accepted"], hint["hint"], hint["status"], hint["vote_status"]) == (False, None, "quarantined", "ok")
    assert sample_value(metrics, "hindsight_judge_guard_hits_total", rule="degenerate", action="quarantine") == 1
    assert sample_value(metrics, "hindsight_judge_verdicts_total", task="prm", status="quarantined") == 1


async def test_a_rejected_next_state_hint_is_refused_once_quarantined() -> None:
    """The rules backend accepts a hint exactly when the user objects; a quarantine refuses it all the same."""
    wrong = [{"role": "user", "content": "Wrong, I asked about the sequel."}]
    body = {**REQ, "next_state": wrong, "tasks": ["hint"]}
    assert (await judge(body))["hint"]["accepted"] is True
    quarantined = await judge({**body, "response": {"content": "no " * 30}})
    assert quarantined["hint"]["accepted"] is False and quarantined["hint"]["status"] == "quarantined"
    assert "prm" not in quarantined and quarantined["guards"][0]["rule"] == "degenerate"


@pytest.mark.parametrize(
    "finish_reason,status", [("length", "quarantined"), ("max_tokens", "quarantined"), ("stop", "ok")]
)
async def test_truncated_reads_the_finish_reason(finish_reason: str, status: str) -> None:
    response = {"content": "Ridley Scott directed", "finish_reason": finish_reason}
    assert (await judge({**REQ, "response": response}))["guards"] == []  # off by default: unmeasured
    body = await judge({**REQ, "response": response}, guards="truncated")
    assert body["prm"]["status"] == status
    assert [g["rule"] for g in body["guards"]] == (["truncated"] if status == "quarantined" else [])


async def test_abstain_withholds_the_score() -> None:
    response = {"content": None, "tool_calls": [{"id": "1", "function": {"name": "browse", "arguments": "{}"}}]}
    body = await judge({**REQ, "response": response, "tools": TOOLS}, guards="malformed_tool_call=abstain")
    prm = body["prm"]
    assert (prm["score"], prm["status"], prm["votes"]) == (None, "abstained", [1, 1, 1])
    assert body["guards"] == [
        {"rule": "malformed_tool_call", "action": "abstain", "detail": "tool 'browse' is not among the offered tools"}
    ]
    # Without the offered tools the name cannot be checked: no hit.
    assert (await judge({**REQ, "response": response}, guards="malformed_tool_call=abstain"))["guards"] == []


async def test_the_strongest_action_decides_and_every_hit_is_listed() -> None:
    next_state = [{"role": "tool", "content": "Error: timeout"}, *THANKS]
    response = {"content": "Ridley Scott directed", "finish_reason": "length"}
    body = await judge(
        {**REQ, "response": response, "next_state": next_state}, guards="tool_error=override,truncated=quarantine"
    )
    assert [(g["rule"], g["action"]) for g in body["guards"]] == [
        ("tool_error", "override"),
        ("truncated", "quarantine"),
    ]
    assert body["prm"]["status"] == "quarantined" and body["prm"]["reason"].startswith("guard truncated:")


async def test_ready_lists_the_guards_and_prompt_versions_name_them() -> None:
    async with rules_judge(guards="tool_error=override") as c:
        ready = (await c.get("/ready")).json()
        answer = (await c.post("/v1/judge", json=REQ)).json()
    assert ready["guards"] == {
        "tool_error": "override",
        "repeated_tool_call": "off",
        "truncated": "off",
        "degenerate": "quarantine",
        "malformed_tool_call": "off",
    }
    version = ready["prompt_versions"]["guards"]
    assert version.startswith("guards@") and answer["prompt_versions"]["guards"] == version
    async with rules_judge() as c:
        default_version = (await c.get("/ready")).json()["prompt_versions"]["guards"]
    assert default_version != version  # a cached verdict made under other guards is told apart


async def test_guards_are_off_the_ready_answer_without_the_key() -> None:
    async with rules_judge(api_key="k" * 32) as c:
        assert (await c.get("/ready")).json() == {"ready": True}
        keyed = await c.get("/ready", headers={"Authorization": "Bearer " + "k" * 32})
    assert keyed.json()["guards"]["degenerate"] == "quarantine"


def test_the_guard_setting_is_a_flag_and_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = parse_settings(JudgeSettings, ["--backend", "rules", "--guards", "tool_error=override,degenerate=off"])
    assert (settings.guards["tool_error"], settings.guards["degenerate"]) == ("override", "off")
    monkeypatch.setenv("HINDSIGHT_JUDGE_GUARDS", "repeated_tool_call=abstain")
    assert parse_settings(JudgeSettings, ["--backend", "rules"]).guards["repeated_tool_call"] == "abstain"


@pytest.mark.parametrize("spec,message", [("bogus=override", "unknown rule 'bogus'"), ("degenerate=ban", "got 'ban'")])
def test_an_unknown_rule_or_action_is_a_startup_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_settings(JudgeSettings, ["--backend", "rules", "--guards", spec])
