"""YAML config: the example file loads; each validation rule fails with a clear message
naming the key; an empty scorer list or enabled: false disables scoring."""

from __future__ import annotations

from pathlib import Path

import pytest

from prm import PRMConfigError, PRMRunner, load_prm_config, parse_prm_config, score_session
from tests.prm.prm_test_scorers import make_turns

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LB = {"path": "prm.scorers.LengthBudgetScorer", "kwargs": {"max_output_tokens": 4}}


def test_example_file_loads():
    cfg = load_prm_config(REPO / "examples" / "prm.yaml")
    assert cfg.prm.active and cfg.prm.advantage_shaping.mode == "process_weighted"
    assert [s.path.rsplit(".", 1)[1] for s in cfg.prm.scorers] == ["LengthBudgetScorer", "LLMJudgeScorer"]
    assert cfg.actor.token_rewards_as_adv is True


@pytest.mark.parametrize(
    "data, match",
    [
        (
            {"prm": {"advantage_shaping": {"mode": "process_weighted"}}, "actor": {"mask_no_eos_with_zero": True}},
            "process_weighted rejects actor.mask_no_eos_with_zero=true",
        ),
        (
            {"prm": {"scorers": [LB]}, "actor": {"token_rewards_as_adv": False}},
            "token_rewards_as_adv=false is rejected while PRM scorers are configured",
        ),
        (
            {"prm": {"advantage_shaping": {"mode": "gvpo"}}, "actor": {"token_rewards_as_adv": False}},
            "mode=gvpo requires actor.token_rewards_as_adv=true",
        ),
        ({"prm": {"scorers": [LB]}, "rollout": {"api_url": "http://x"}}, "rollout.api_url"),
        ({"prm": {"advantage_shaping": {"mode": "ppo"}}}, "prm.advantage_shaping.mode"),
        (
            {"prm": {"advantage_shaping": {"zero_penalty": -1}}},
            "prm.advantage_shaping.zero_penalty: must be finite and >= 0",
        ),
        ({"prm": {"scorers": [{"path": "LengthBudgetScorer"}]}}, "prm.scorers.0.*dotted Python path"),
        (
            {"prm": {"scorers": [{"path": "judge_server.prm.scorers.LengthBudgetScorer"}]}},
            "judge_server.prm moved to the top-level package prm; write 'prm.scorers.LengthBudgetScorer'",
        ),
        ({"prm": {"scorers": [{**LB, "weight": float("inf")}]}}, "weight must be finite"),
        ({"prm": {"scorers": [{**LB, "kwargs": {"weight": 2}}]}}, "not inside kwargs"),
        ({"prm": {"scorers": [{**LB, "wieght": 2}]}}, "prm.scorers.0.*wieght"),
        ({"prm": {"enabeld": True}}, "prm.enabeld"),
    ],
)
def test_rules_fail_with_clear_messages(data, match):
    with pytest.raises(PRMConfigError, match=match):
        parse_prm_config(data)


def test_token_rewards_as_adv_false_is_fine_without_active_scorers():
    assert not parse_prm_config({"prm": {"scorers": []}, "actor": {"token_rewards_as_adv": False}}).prm.active
    assert not parse_prm_config(
        {"prm": {"enabled": False, "scorers": [LB]}, "actor": {"token_rewards_as_adv": False}}
    ).prm.active


def test_areal_nesting_is_accepted():
    cfg = parse_prm_config(
        {"rollout": {"_version": "v1", "agent": {"prm": {"scorers": [LB]}}}, "actor": {"token_rewards_as_adv": True}}
    )
    assert cfg.prm.active and cfg.prm.scorers[0].kwargs == {"max_output_tokens": 4}


def test_bad_files(tmp_path):
    with pytest.raises(PRMConfigError, match="cannot read PRM config"):
        load_prm_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("prm: [unclosed\n")
    with pytest.raises(PRMConfigError, match="not valid YAML"):
        load_prm_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(PRMConfigError, match="must be a mapping"):
        load_prm_config(tmp_path / "list.yaml")


@pytest.mark.parametrize("prm", [{"enabled": False, "scorers": [LB]}, {"scorers": []}])
async def test_disabled_or_empty_means_no_scoring(prm):
    runner = await PRMRunner.create({"prm": prm})
    assert not runner.active
    assert await score_session(runner, make_turns(2)) == {}
    assert runner.metrics.snapshot() == {}
    await runner.aclose()
