"""Session-scope PRM scoring (``--prm-scope session``; policy_server.rewards.scoring, docs/SCORERS.md "Wiring").

End to end: client -> real policy server process -> dev engine; dispatcher -> real judge server (rules backend:
"thanks"/"worked" +1, "wrong"/"No," -1) for the reward pipeline; the PRM scorers are the trajectory scorer
``tests.policy.prm_session_scorers.TrajectoryProbe`` (loaded by dotted path in the server process; it records what it saw
and rewards turn i of an n-turn trajectory with 10 n + i) plus ``LengthBudgetScorer``. Checked:

- the trajectory scorer is called ONCE per session, with every turn parent-before-child and its next state
  (the rejected final turn as context), and its per-turn rewards land on the right samples;
- accepted turns are held ``pending_score`` (reported by stats and GET /v1/samples, never leased) until the
  session ends; an idle-timeout end triggers the scoring;
- a scorer rejection rejects every held sample of the session with ``prm_rejected: ...``;
- an unreachable scorer dependency keeps the samples held (attempts noted), and after kill -9 and a restart
  the held sessions (one ended, one still open at the kill) are scored exactly once.
In-process unit tests cover the store's pending_score state machine and the session outcome mapping.
"""

from __future__ import annotations

import json
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from engine.records import Sample, TurnRecord
from judge_server.errors import JudgeUnavailable
from policy_server.rewards.scoring import PRMScoring, held_outcomes, session_turns
from policy_server.store import Resolution, Store
from policy_server.store.records import ScoredSample
from prm import BaseTrajectoryScorer, PRMConfig, PRMFileConfig, PRMRunner
from tests.testkit.procs import free_port
from tests.testkit.servers import (
    admin,
    chat,
    lease_all,
    of_session,
    pythonpath_with_repo,
    samples_of,
    start_prm_policy,
    stats,
    stats_once,
    stored_samples,
)
from tests.waiting import wait_until

BUDGET = 3
W_LEN = 0.5
IDLE_S = 6.0  # long enough that a test's consecutive requests never idle out, short enough to wait for
POSITIVE = "Thanks, that worked."
NEGATIVE = "No, that is wrong. Use the other file in /tmp."
REJECT = "Thanks, that worked. REJECT-ME"


def probe_yaml(path: Path, record: Path, flag: Path | None = None) -> Path:
    flag_kw = f', unavailable_flag: "{flag}"' if flag is not None else ""
    path.write_text(f"""
prm:
  enabled: true
  advantage_shaping: {{mode: additive}}
  scorers:
    - path: tests.policy.prm_session_scorers.TrajectoryProbe
      weight: 1.0
      kwargs: {{record_path: "{record}", reject_marker: "REJECT-ME"{flag_kw}}}
    - path: prm.scorers.LengthBudgetScorer
      weight: {W_LEN}
      kwargs: {{max_output_tokens: {BUDGET}}}
actor:
  token_rewards_as_adv: true
""")
    return path


def expected_rewards(n_traj: int, turn_index: int, n_tokens: int) -> list[float]:
    return [10.0 * n_traj + turn_index + W_LEN * float(n_tokens <= BUDGET)] * n_tokens


def new_sid() -> str:
    return f"scope-{uuid.uuid4().hex[:8]}"


def talk(url: str, sid: str, feedback: list[tuple[str, int]], *, end: bool) -> None:
    """Turn i is generated with max_tokens feedback[i][1] and answered by feedback[i][0]; one more request
    follows (its turn has no next state): with ``end`` it carries X-Session-Done, else the session stays open
    and that turn awaits its next state."""
    msgs: list[dict] = [
        {"role": "system", "content": "You help with files."},
        {"role": "user", "content": "Open the report."},
    ]
    for text, max_tokens in feedback:
        reply = chat(url, sid, msgs, max_tokens=max_tokens)
        msgs = msgs + [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": text}]
    chat(url, sid, msgs, max_tokens=2, done=end)


def rows(url: str, sid: str, status: str | None = None) -> list[dict]:
    with admin(url) as c:
        r = c.get("/v1/samples", params={"session_id": sid, **({"status": status} if status else {})})
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def wait_rows(url: str, sid: str, want: dict[int, str], timeout_s: float = 60.0) -> list[dict]:
    """Until the session's samples have exactly the statuses ``want`` (turn_index -> status)."""

    def reached() -> list[dict] | None:
        got = rows(url, sid)
        return got if {r["turn_index"]: r["status"] for r in got} == want else None

    def seen() -> str:
        got = [(r["turn_index"], r["status"], r["reject_reason"], r["last_error"]) for r in rows(url, sid)]
        return f"session {sid} did not reach {want}: {got}"

    return wait_until(reached, timeout_s=timeout_s, interval_s=0.1, message=seen)


def probe_calls(record: Path, sid: str) -> list[dict]:
    if not record.exists():
        return []
    return [c for c in map(json.loads, record.read_text().splitlines()) if c["session_id"] == sid]


# ------------------------------------------------------------------ e2e fixtures
@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prm-session-logs")


# A session-scope policy server whose process imports the probe scorer from the repository.
_SESSION_ARGS = ["--session-idle-timeout-s", str(IDLE_S), "--idle-sweep-interval-s", "0.2", "--prm-scope", "session"]
_policy = partial(start_prm_policy, extra=_SESSION_ARGS, env=pythonpath_with_repo())


@pytest.fixture(scope="module")
def scoped(tiny_model_dir, engine, rules_judge, logs, tmp_path_factory):
    """One session-scope policy server shared by the tests that need no restart; yields (url, probe record)."""
    d = tmp_path_factory.mktemp("prm-session")
    record = d / "probe.jsonl"
    pol = _policy(
        tiny_model_dir, engine, rules_judge, d / "data", logs, "policy-session", probe_yaml(d / "prm.yaml", record)
    )
    yield pol.url, record
    pol.stop()


# ------------------------------------------------------------------ e2e tests
@pytest.mark.e2e
def test_trajectory_scorer_sees_the_whole_session_and_rewards_land_on_their_turns(scoped):
    url, record = scoped
    sid = new_sid()
    talk(url, sid, [(POSITIVE, 2), (NEGATIVE, 12)], end=True)
    wait_rows(url, sid, {0: "ready", 1: "ready", 2: "rejected"})
    calls = probe_calls(record, sid)
    assert len(calls) == 1, calls  # the whole session, scored once
    turns = calls[0]["turns"]
    assert [t["turn_index"] for t in turns] == [0, 1, 2]
    assert [t["parent_id"] for t in turns] == [None, f"{sid}:0", f"{sid}:1"]
    assert [t["next_state"] for t in turns] == [[POSITIVE], [NEGATIVE], []]
    # held turns are the ones trained on; the final turn (no next state) is context only
    assert [t["sample_status"] for t in turns] == ["pending_score", "pending_score", "rejected"]
    assert turns[2]["reject_reason"] == "no_next_state"
    body = lease_all(url)
    got = of_session(body["samples"], sid)
    assert sorted(got) == [0, 1]
    for idx, judge_score in ((0, 1.0), (1, -1.0)):
        s = got[idx]
        n = len(s["response_ids"])
        assert n == turns[idx]["output_len"] and s["reward"] == judge_score and s["loss_mask"] == [1] * n
        assert s["token_rewards"] == pytest.approx(expected_rewards(3, idx, n))
    # one scored session: the branch total counts all three turns (context included), once
    m = body["prm_metrics"]
    assert m["rollout/prm_trajectory_reward/trajectory_probe"] == pytest.approx(30 + 31 + 32)
    st = stats(url)
    assert st["prm"]["scope"] == "session" and st["prm"]["sessions"]["rollout/scored"] >= 1
    assert st["samples"]["pending_score"] == 0


@pytest.mark.e2e
def test_held_until_the_idle_timeout_ends_the_session(scoped):
    url, record = scoped
    sid = new_sid()
    talk(url, sid, [(POSITIVE, 2)], end=False)
    # turn 0 was judged ready by the pipeline but is held: turn 1 still awaits, the session is open
    held = wait_rows(url, sid, {0: "pending_score"}, timeout_s=IDLE_S - 1)
    assert held[0]["sample"]["token_rewards"] is None and held[0]["sample"]["prm"]["score"] == 1
    assert [r["turn_index"] for r in rows(url, sid, status="pending_score")] == [0]
    assert stats(url)["samples"]["pending_score"] >= 1
    assert of_session(lease_all(url)["samples"], sid) == {}  # not leasable before the session ends
    assert probe_calls(record, sid) == []
    # no more traffic: the idle sweep ends the session, turn 1 is rejected no_next_state, then scoring runs
    done = wait_rows(url, sid, {0: "ready", 1: "rejected"}, timeout_s=IDLE_S + 30)
    assert done[1]["reject_reason"] == "no_next_state"
    calls = probe_calls(record, sid)
    assert len(calls) == 1 and [t["turn_index"] for t in calls[0]["turns"]] == [0, 1]
    got = of_session(lease_all(url)["samples"], sid)
    n = len(got[0]["response_ids"])
    assert got[0]["token_rewards"] == pytest.approx(expected_rewards(2, 0, n))


@pytest.mark.e2e
def test_scorer_rejection_rejects_every_held_sample(scoped):
    url, record = scoped
    sid = new_sid()
    talk(url, sid, [(POSITIVE, 2), (REJECT, 2)], end=True)
    got = wait_rows(url, sid, {0: "rejected", 1: "rejected", 2: "rejected"})
    assert got[2]["reject_reason"] == "no_next_state"
    reasons = {r["reject_reason"] for r in got[:2]}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    assert reason.startswith("prm_rejected: ") and "trajectory_probe" in reason and "returned None" in reason
    for r in got[:2]:
        d = r["sample"]
        assert d["token_rewards"] is None and d["loss_mask"] == [0] * len(d["response_ids"])
        assert d["prm"]["score"] == 1  # the pipeline had accepted it: the session veto overrides
    assert len(probe_calls(record, sid)) == 1
    assert of_session(lease_all(url)["samples"], sid) == {}
    assert stats(url)["reject_reasons"][reason] == 2


@pytest.mark.e2e
@pytest.mark.slow
def test_unreachable_scorer_keeps_held_across_kill9_then_scores_once(
    tiny_model_dir, engine, rules_judge, logs, tmp_path
):
    record, flag = tmp_path / "probe.jsonl", tmp_path / "probe-down"
    flag.touch()  # the probe's dependency is down until the flag is removed
    cfg = probe_yaml(tmp_path / "prm.yaml", record, flag)
    data, port = tmp_path / "data", free_port()
    pol = _policy(tiny_model_dir, engine, rules_judge, data, logs, "policy-session-a", cfg, port=port)
    try:
        ended, open_sid = new_sid(), new_sid()
        talk(pol.url, open_sid, [(POSITIVE, 2)], end=False)  # turn 0 paired, turn 1 awaits: held, session open
        talk(pol.url, ended, [(POSITIVE, 2), (NEGATIVE, 2)], end=True)
        wait_rows(pol.url, open_sid, {0: "pending_score"})
        st = stats_once(pol.url, "pending_score_retrying")
        assert st["samples"]["ready"] == 0 and st["samples"]["pending_score"] == 3
        assert st["prm"]["turns"]["retry"] >= 1 and st["prm"]["turns"]["scored"] == 0
        assert lease_all(pol.url)["samples"] == []
        pol.kill()
        held = {r.turn_index: r for r in stored_samples(data, ended)}
        opened = {r.turn_index: r for r in stored_samples(data, open_sid)}
        assert [held[i].status for i in (0, 1, 2)] == ["pending_score", "pending_score", "rejected"]
        assert held[0].attempts >= 1 and (held[0].last_error or "").startswith("prm: JudgeUnavailable: ")
        assert opened[0].status == "pending_score"
        assert probe_calls(record, ended) == []
        flag.unlink()
        pol = _policy(tiny_model_dir, engine, rules_judge, data, logs, "policy-session-b", cfg, port=port)
        wait_rows(pol.url, ended, {0: "ready", 1: "ready", 2: "rejected"})
        # the open session ends by the idle timeout after the restart (its activity time is stored)
        wait_rows(pol.url, open_sid, {0: "ready", 1: "rejected"}, timeout_s=IDLE_S + 30)
        got = lease_all(pol.url)["samples"]
        for sid, n_traj, idxs in ((ended, 3, (0, 1)), (open_sid, 2, (0,))):
            mine = of_session(got, sid)
            assert sorted(mine) == list(idxs)
            for idx in idxs:
                n = len(mine[idx]["response_ids"])
                assert mine[idx]["token_rewards"] == pytest.approx(expected_rewards(n_traj, idx, n))
            assert len(probe_calls(record, sid)) == 1  # scored exactly once
        assert stats(pol.url)["samples"]["pending_score"] == 0
    finally:
        pol.stop()


# ------------------------------------------------------------------ unit tests (in process)
def _record(store: Store, sid: str, text: str) -> int:
    rec = {
        "messages": [{"role": "user", "content": text}],
        "response": {"content": "ok", "tool_calls": []},
        "prompt_ids": [1, 2, 3],
        "response_ids": [7, 8],
        "rollout_logprobs": [-0.1, -0.2],
        "tools": None,
        "weight_version": "v0",
    }
    return store.record_turn(sid, TurnRecord.model_validate(rec), session_done=False)


def _sample_id(store: Store, sid: str, idx: int) -> str:
    return next(r.sample_id for r in samples_of(store, sid) if r.turn_index == idx)


def _held_session(store: Store, sid: str = "s") -> None:
    """Turn 0 held pending_score, turn 1 (the session's last) rejected no_next_state, session done."""
    _record(store, sid, "hi")
    store.resolve_turn(sid, Resolution(0, "paired", [{"role": "user", "content": "thanks"}]))
    _record(store, sid, "more")
    data = {"loss_mask": [1, 1], "reward": 1.0, "token_rewards": None, "prm": {"score": 1}, "response_ids": [7, 8]}
    assert store.complete_judge(
        _sample_id(store, sid, 0),
        status="pending_score",
        reject_reason=None,
        included=True,
        data=Sample.model_validate(data),
    )
    assert store.scorable_sessions() == []  # the session is still open
    store.end_session(sid)
    assert store.scorable_sessions() == []  # its last turn is not decided yet
    store.complete_judge(
        _sample_id(store, sid, 1),
        status="rejected",
        reject_reason="no_next_state",
        included=False,
        data=Sample(loss_mask=[0, 0]),
    )


@pytest.mark.unit
def test_store_pending_score_state_machine(store_factory):
    store = store_factory()
    try:
        _held_session(store)
        st = store.stats()
        assert st.samples["pending_score"] == 1 and st.pending_score_retrying == 0
        assert store.lease(10, 60.0) is None  # held samples are never leased
        assert store.unconsumed_backlog() == 1
        assert store.scorable_sessions() == ["s"] and store.scorable_sessions("s") == ["s"]
        assert store.scorable_sessions("other") == []
        # scoring is claimed like judge work: a replica's live claim hides the session from the other replicas
        assert store.claim_session("s", "A", 10.0, now=100.0)
        assert store.scorable_sessions(available_to="B", now=101.0) == []
        assert store.scorable_sessions(available_to="A", now=101.0) == ["s"]
        assert store.scorable_sessions(available_to="B", now=111.0) == ["s"]  # A's claim expired: B may finish it
        store.release_session("s", "A")
        assert [r.turn_index for r in store.list_samples(status="pending_score")] == [0]
        assert store.note_score_attempt("s", "prm: JudgeUnavailable: down") == 1
        assert store.stats().pending_score_retrying == 1
        traj = store.session_trajectory("s")
        assert [(t.turn.turn_index, t.sample and t.sample.status) for t in traj] == [
            (0, "pending_score"),
            (1, "rejected"),
        ]
        sid0 = _sample_id(store, "s", 0)
        held = traj[0].sample
        assert held is not None and held.sample is not None
        data = Sample.model_validate({**held.sample, "token_rewards": [0.5, 0.5]})
        assert store.complete_score([ScoredSample(sid0, "ready", None, data)]) == 1
        assert store.complete_score([ScoredSample(sid0, "rejected", "prm_rejected: late", data)]) == 0  # decided once
        assert store.scorable_sessions() == []
        _, leased = store.lease(10, 60.0)
        assert [s.token_rewards for s in leased] == [[0.5, 0.5]]
        with pytest.raises(ValueError):
            store.complete_score([ScoredSample(sid0, "pending_score", None, data)])
        # a reopened session holds again until it ends again
        _held_session(store, "r")
        store.touch_session("r")
        assert store.scorable_sessions() == []
    finally:
        store.close()


class _Probe(BaseTrajectoryScorer):
    name = "probe"

    def __init__(self, result: Any = "ids", error: BaseException | None = None):
        super().__init__(weight=2.0)
        self.result, self.error, self.seen = result, error, []

    async def evaluate_trajectory(self, interactions, ctx):
        if self.error is not None:
            raise self.error
        self.seen.append([(it.turn_index, it.parent_id, it.extra["sample_status"]) for it in interactions])
        return None if self.result is None else {it.interaction_id: float(it.turn_index + 1) for it in interactions}


async def _scoring(scorer: BaseTrajectoryScorer) -> PRMScoring:
    config = PRMFileConfig(prm=PRMConfig(scorers=[scorer]))
    return PRMScoring(await PRMRunner.create(config), "<test>", config, scope="session")


@pytest.mark.unit
async def test_session_outcomes_in_process(store_factory):
    store = store_factory()
    try:
        _held_session(store)
        traj = store.session_trajectory("s")
    finally:
        store.close()
    turns = session_turns(traj)
    assert [(t["turn_index"], t["parent_turn_index"], t["next_state"]) for t in turns] == [
        (0, None, [{"role": "user", "content": "thanks"}]),
        (1, 0, []),
    ]
    assert turns[0]["judge_prm"] == {"score": 1} and turns[1]["reject_reason"] == "no_next_state"

    probe = _Probe()
    ok = await _scoring(probe)
    out = await ok.score_held_session(traj)
    assert out.kind == "scored" and out.token_rewards == {0: [2.0, 2.0]}  # weight 2 x (0 + 1); turn 1 gets none
    assert probe.seen == [[(0, None, "pending_score"), (1, "s:0", "rejected")]]
    [scored] = held_outcomes(traj, out)
    assert (scored.status, scored.reject_reason, scored.sample.token_rewards, scored.sample.loss_mask) == (
        "ready",
        None,
        [2.0, 2.0],
        [1, 1],
    )

    rej = await (await _scoring(_Probe(result=None))).score_held_session(traj)
    assert rej.kind == "rejected" and rej.reason.startswith("prm_rejected: trajectory scorer 'probe' returned None")
    [scored] = held_outcomes(traj, rej)
    assert (scored.status, scored.reject_reason, scored.sample.token_rewards, scored.sample.loss_mask) == (
        "rejected",
        rej.reason,
        None,
        [0, 0],
    )

    down = await _scoring(_Probe(error=JudgeUnavailable("judge down")))
    retry = await down.score_held_session(traj)
    assert retry.kind == "retry" and "JudgeUnavailable" in retry.reason
    assert down.outcomes == {"scored": 0, "rejected": 0, "retry": 1}
    assert ok.outcomes == {"scored": 1, "rejected": 0, "retry": 0}
    await ok.aclose()
    closed = await ok.score_held_session(traj)
    assert closed.kind == "retry" and "PRMRunnerClosed" in closed.reason
