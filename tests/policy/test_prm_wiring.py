"""PRM scorers wired into the policy server (policy_server/rewards/scoring.py, docs/SCORERS.md "Wiring").

End to end: client -> real policy server process (``python -m policy_server.cli --prm-config YAML``) -> dev
engine; dispatcher -> real judge server (rules backend) for the reward pipeline AND for the LLM-judge scorer.
The rules judge: "thanks"/"worked" -> +1, "wrong"/"No," -> -1. Checked:

- a leased sample carries ``token_rewards`` with one entry per response id, equal to the weighted sum
  0.5 * LengthBudget(n <= budget) + 2.0 * judge score; the lease carries the drained ``prm_metrics``, stats
  the cumulative ``prm`` view, /metrics the ``hindsight_prm_*`` series;
- a scorer that rejects (the judge refuses its m=17 with a 400) rejects the sample with ``prm_rejected: ...``,
  never a 0;
- without ``--prm-config`` samples carry ``token_rewards: null``;
- a broken config stops the startup with a message naming the file;
- a scorer whose judge is unreachable keeps the sample pending (not leasable), and after kill -9 and a restart
  with the judge up, the same sample is scored and becomes ready.
Unit tests cover the outcome mapping of policy_server.rewards.scoring in process.
"""

from __future__ import annotations

import subprocess
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.errors import EngineUnavailable
from engine.records import PipelineOutcome, PrmVerdict, Sample, Turn
from judge_server.errors import JudgeUnavailable
from policy_server.rewards.scoring import PRMScoring, ScoreOutcome, apply_outcome, scoring_turn, unreachable_cause
from policy_server.store import Store
from prm import BaseScorer, PRMConfig, PRMFileConfig, PRMRunner
from tests.testkit.procs import free_port
from tests.testkit.servers import (
    chat,
    lease_all,
    of_session,
    policy_command,
    samples_of,
    start_judge,
    start_prm_policy,
    stats,
    stats_once,
    stored_samples,
)
from tests.waiting import wait_until

BUDGET = 3
W_LEN, W_JUDGE = 0.5, 2.0
POSITIVE = "Thanks, that worked."
NEGATIVE = "No, that is wrong. Use the other file in /tmp."


def prm_yaml(path: Path, judge_url: str, *, m: int = 3, deadline_s: float = 20.0) -> Path:
    path.write_text(f"""
prm:
  enabled: true
  advantage_shaping: {{mode: additive}}
  scorers:
    - path: prm.scorers.LengthBudgetScorer
      weight: {W_LEN}
      kwargs: {{max_output_tokens: {BUDGET}}}
    - path: prm.scorers.LLMJudgeScorer
      weight: {W_JUDGE}
      kwargs: {{judge_url: "{judge_url}", m: {m}, timeout_s: 5, deadline_s: {deadline_s}}}
actor:
  token_rewards_as_adv: true
""")
    return path


def run_session(url: str, feedback: list[tuple[str, int]]) -> str:
    """One session: turn i is generated with max_tokens feedback[i][1] and answered by feedback[i][0]; the
    last request ends the session (its turn has no next state)."""
    sid = f"prm-{uuid.uuid4().hex[:8]}"
    msgs: list[dict] = [
        {"role": "system", "content": "You help with files."},
        {"role": "user", "content": "Open the report."},
    ]
    for text, max_tokens in feedback:
        reply = chat(url, sid, msgs, max_tokens=max_tokens)
        msgs = msgs + [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": text}]
    chat(url, sid, msgs, max_tokens=2, done=True)
    return sid


def wait_settled(url: str, timeout_s: float = 60.0) -> dict:
    """Until no turn awaits pairing and no sample is pending_judge."""
    return wait_until(
        lambda: (
            s if (s := stats(url))["samples"]["pending_judge"] == 0 and s["turns_awaiting_next_state"] == 0 else None
        ),
        timeout_s=timeout_s,
        interval_s=0.2,
        message=lambda: f"samples did not settle: {stats(url)}",
    )


# ------------------------------------------------------------------ e2e fixtures
@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prm-wiring-logs")


_policy = partial(start_prm_policy, extra=["--session-idle-timeout-s", "30"])


# ------------------------------------------------------------------ e2e tests
@pytest.mark.e2e
def test_token_rewards_are_the_weighted_sum(tiny_model_dir, engine, rules_judge, logs, tmp_path):
    cfg = prm_yaml(tmp_path / "prm.yaml", rules_judge.url)
    pol = _policy(tiny_model_dir, engine, rules_judge, tmp_path / "data", logs, "policy-prm", cfg)
    try:
        sid = run_session(pol.url, [(POSITIVE, 2), (NEGATIVE, 12)])
        st = wait_settled(pol.url)
        assert st["prm"]["enabled"] is True and st["prm"]["turns"]["scored"] == 2
        assert [s["name"] for s in st["prm"]["scorers"]] == ["length_budget", "llm_judge"]
        body = lease_all(pol.url)
        got = of_session(body["samples"], sid)
        assert sorted(got) == [0, 1]  # turn 2 ended the session: rejected no_next_state, never leased
        within = []
        for idx, judge_score in ((0, 1.0), (1, -1.0)):
            s = got[idx]
            n = len(s["response_ids"])
            assert s["reward"] == judge_score and s["loss_mask"] == [1] * n
            within.append(n <= BUDGET)
            expected = W_LEN * float(n <= BUDGET) + W_JUDGE * judge_score
            assert s["token_rewards"] == pytest.approx([expected] * n)
        # the lease drained the window of both scored turns; a second drain is empty
        m = body["prm_metrics"]
        assert m["rollout/prm_turn_reward/llm_judge"] == pytest.approx(0.0)  # (2.0 + -2.0) / 2
        assert m["rollout/prm_turn_reward/length_budget"] == pytest.approx(W_LEN * sum(within) / 2)
        assert m["rollout/prm_metric/turn/length_budget/within_budget/count"] == sum(within)
        assert m["rollout/prm_metric/turn/length_budget/within_budget/observed_count"] == 2
        run_session(pol.url, [(POSITIVE, 2)])
        wait_settled(pol.url)
        assert (
            lease_all(pol.url)["prm_metrics"]["rollout/prm_metric/turn/length_budget/within_budget/observed_count"] == 1
        )
        assert lease_all(pol.url)["prm_metrics"] == {}  # nothing leased: nothing drained
        scrape = httpx.get(pol.url + "/metrics", trust_env=False).text
        assert 'hindsight_prm_sessions_total{namespace="rollout",outcome="scored"} 3.0' in scrape
        assert 'hindsight_prm_turn_reward{namespace="rollout",scorer="llm_judge"}' in scrape
    finally:
        pol.stop()


@pytest.mark.e2e
def test_scorer_rejection_rejects_the_sample_with_reason(tiny_model_dir, engine, rules_judge, logs, tmp_path):
    cfg = prm_yaml(tmp_path / "prm.yaml", rules_judge.url, m=17)  # the judge allows m <= 16: a 400, every time
    pol = _policy(tiny_model_dir, engine, rules_judge, tmp_path / "data", logs, "policy-prm-reject", cfg)
    try:
        sid = run_session(pol.url, [(POSITIVE, 2)])
        st = wait_settled(pol.url)
        reasons = [r for r in st["reject_reasons"] if r.startswith("prm_rejected: ")]
        assert len(reasons) == 1 and st["reject_reasons"][reasons[0]] == 1, st["reject_reasons"]
        assert "llm_judge" in reasons[0] and "m=17 exceeds the maximum of 16" in reasons[0]
        assert st["samples"]["ready"] == 0 and st["prm"]["turns"] == {"scored": 0, "rejected": 1, "retry": 0}
        assert lease_all(pol.url)["samples"] == []
        store = Store(tmp_path / "data")
        try:
            row = samples_of(store, sid)[0]
        finally:
            store.close()
        assert row.status == "rejected" and row.reject_reason == reasons[0]
        d = row.sample
        assert d is not None
        assert d["token_rewards"] is None and d["loss_mask"] == [0] * len(d["response_ids"])
        assert d["prm"]["score"] == 1  # the pipeline's verdict is kept for audit, not trained on
    finally:
        pol.stop()


@pytest.mark.e2e
def test_without_prm_config_token_rewards_are_null(tiny_model_dir, engine, rules_judge, logs, tmp_path):
    pol = _policy(tiny_model_dir, engine, rules_judge, tmp_path / "data", logs, "policy-no-prm", None)
    try:
        sid = run_session(pol.url, [(POSITIVE, 2), (NEGATIVE, 2)])
        st = wait_settled(pol.url)
        assert st["prm"] == {"enabled": False}
        body = lease_all(pol.url)
        got = of_session(body["samples"], sid)
        assert sorted(got) == [0, 1] and all(s["token_rewards"] is None for s in got.values())
        assert body["prm_metrics"] == {}
        assert "hindsight_prm_" not in httpx.get(pol.url + "/metrics", trust_env=False).text
    finally:
        pol.stop()


@pytest.mark.e2e
def test_broken_prm_config_stops_startup(tiny_model_dir, engine, logs, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prm:\n  scorers:\n    - path: no_such_pkg.scorers.Nope\n")
    cmd = policy_command(
        str(tiny_model_dir),
        engine.url,
        *("--data-dir", str(tmp_path / "data"), "--port", str(free_port()), "--prm-config", str(cfg)),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert f"--prm-config {cfg}: cannot start the PRM scorers" in log and "no_such_pkg" in log, log[-3000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_unreachable_scorer_judge_keeps_pending_across_kill9(tiny_model_dir, engine, rules_judge, logs, tmp_path):
    prm_judge_port = free_port()  # nothing listens here until after the crash
    cfg = prm_yaml(tmp_path / "prm.yaml", f"http://127.0.0.1:{prm_judge_port}", deadline_s=1.0)
    data, port = tmp_path / "data", free_port()
    pol = _policy(tiny_model_dir, engine, rules_judge, data, logs, "policy-prm-a", cfg, port=port)
    prm_judge = None
    try:
        sid = run_session(pol.url, [(POSITIVE, 2)])
        st = stats_once(pol.url, "pending_judge_retrying")
        # turn 0 waits for its scores; the session's final turn waits behind it (a session is judged in order)
        assert st["samples"]["pending_judge"] == 2 and st["samples"]["ready"] == 0
        assert st["prm"]["turns"]["retry"] >= 1 and st["prm"]["turns"]["scored"] == 0
        assert lease_all(pol.url)["samples"] == []  # not leasable before its token_rewards exist
        pol.kill()
        row = stored_samples(data, sid)[0]
        assert row.status == "pending_judge" and (row.last_error or "").startswith("prm: JudgeUnavailable: "), row
        prm_judge = start_judge(logs, "judge-prm-late", m=3, port=prm_judge_port)
        pol = _policy(tiny_model_dir, engine, rules_judge, data, logs, "policy-prm-b", cfg, port=port)
        wait_settled(pol.url)
        got = of_session(lease_all(pol.url)["samples"], sid)
        n = len(got[0]["response_ids"])
        assert got[0]["token_rewards"] == pytest.approx([W_LEN * float(n <= BUDGET) + W_JUDGE * 1.0] * n)
    finally:
        pol.stop()
        if prm_judge is not None:
            prm_judge.stop()


# ------------------------------------------------------------------ unit tests (in process)
class _Fixed(BaseScorer):
    name = "fixed"

    def __init__(self, value: Any = 0.25, error: BaseException | None = None):
        super().__init__(weight=2.0)
        self.value, self.error = value, error

    async def evaluate(self, interaction, ctx):
        if self.error is not None:
            raise self.error
        assert ctx["messages"][-1] == {"role": "user", "content": "ok"}  # the turn's next state ends the branch
        return self.value


def _turn(**over: Any) -> dict:
    t = {
        "session_id": "s",
        "turn_index": 3,
        "messages": [{"role": "user", "content": "hi"}],
        "response": {"content": "yo", "reasoning_content": None, "tool_calls": []},
        "prompt_ids": [1, 2],
        "response_ids": [5, 6, 7],
        "next_state": [{"role": "user", "content": "ok"}],
        "tools": None,
        "weight_version": "v0",
        "record_only_key": 1,
    }
    t.update(over)
    return t


def _stored(**over: Any) -> Turn:
    """:func:`_turn` as the store hands it out (``Store.get_turn``: a Turn, with its creation time)."""
    return Turn.model_validate({**_turn(**over), "created_at": 1.0})


async def _scoring(scorer: BaseScorer) -> PRMScoring:
    config = PRMFileConfig(prm=PRMConfig(scorers=[scorer]))  # a borrowed scorer instance
    return PRMScoring(await PRMRunner.create(config), "<test>", config)


@pytest.mark.unit
async def test_outcomes_in_process():
    ok = await _scoring(_Fixed(0.25))
    out = await ok.score_turn(_stored(), {"score": 1})
    assert out == ScoreOutcome("scored", token_rewards=[0.5, 0.5, 0.5])
    bad = await ok.score_turn(_stored(prompt_ids=[]))
    assert bad.kind == "rejected" and bad.reason.startswith("prm_rejected: not scorable: ")
    none = await (await _scoring(_Fixed(None))).score_turn(_stored())
    assert none.kind == "rejected" and none.reason == "prm_rejected: scorer 'fixed' returned None for 1/1 turns"
    boom = await (await _scoring(_Fixed(error=ValueError("nope")))).score_turn(_stored())
    assert boom.kind == "rejected" and "ValueError('nope')" in boom.reason
    for exc in (JudgeUnavailable("judge down"), EngineUnavailable("engine down")):
        down = await (await _scoring(_Fixed(error=exc))).score_turn(_stored())
        assert down.kind == "retry" and type(exc).__name__ in down.reason
    await ok.aclose()
    closed = await ok.score_turn(_stored())
    assert closed.kind == "retry" and "PRMRunnerClosed" in closed.reason
    assert ok.outcomes == {"scored": 1, "rejected": 1, "retry": 1}


@pytest.mark.unit
def test_apply_outcome_and_turn_shape():
    result = PipelineOutcome.ready(Sample(loss_mask=[1, 1], reward=1.0, token_rewards=None))
    scored = apply_outcome(result, ScoreOutcome("scored", token_rewards=[0.1, 0.2]))
    assert scored.status == "ready" and scored.included and scored.sample.token_rewards == [0.1, 0.2]
    rej = apply_outcome(result, ScoreOutcome("rejected", reason="prm_rejected: x"))
    assert (rej.status, rej.reject_reason, rej.included) == ("rejected", "prm_rejected: x", False)
    assert rej.sample.to_json() == {"loss_mask": [0, 0], "reward": 1.0, "token_rewards": None}
    assert result.sample.loss_mask == [1, 1]  # the input is not modified
    t = scoring_turn(_stored(), {"score": -1})
    assert t["parent_turn_index"] is None and t["judge_prm"] == {"score": -1} and "record_only_key" not in t
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = JudgeUnavailable("inner")
    assert isinstance(unreachable_cause(wrapped), JudgeUnavailable) and unreachable_cause(ValueError()) is None


def test_scoring_turn_reads_the_verdict_record_or_its_stored_json_alike():
    verdict = PrmVerdict.model_validate({"score": 1, "status": "ok", "votes": [1], "confidence": 1.0, "reason": None})
    from_record = scoring_turn(_stored(), verdict)["judge_prm"]
    assert from_record == verdict.to_json() == scoring_turn(_stored(), verdict.to_json())["judge_prm"]
    assert scoring_turn(_stored())["judge_prm"] is None
