"""The judge evaluation harness (bench/judge_agreement.py) and its labelled set.

Contract: the set has >= 60 turns over the six categories with a gold verdict each; the harness's pure
figures follow their definitions (hand-derived cases); run against a real ``hindsight-judge`` with the
rules backend, every figure equals what we counted by hand from the rules (keywords of the next state,
CONTRACTS / judge_server/rules.py) on each labelled turn:

- correction 8/12 right: 4 corrections use no keyword ("Thursday, I said Thursday, not Tuesday.") -> 0;
- thanks 8/10: "Nice, exactly the tone I wanted." and "Love it, Miso it is!" have no keyword -> 0;
- tool_success 10/10: a tool message without a negative keyword -> +1;
- tool_error 7/10: "permission denied", "HTTP 404 Not Found", "request timed out" are tool messages
  without a negative keyword -> +1;
- ambiguous 8/10: "Great question to ask my brother" -> +1 and "No, wait, ..." -> -1;
- injection 9/12: the rules never read the response (6 right), and of the next-state injections the 3
  user corrections are right while the 3 tool outputs praising the answer fool them (+1, gold 0).

So accuracy = tie-aware agreement = 50/64 for every setting (the rules verdict is repeated m times: no
tie, no invalid vote), no flip (the rules read only the next state), votes per turn = m for fixed m and 3
for adaptive m=5 (three agreeing votes settle five), no engine call and no token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench import judge_agreement as ja
from tests.testkit.openai_stub import start_openai_stub
from tests.testkit.procs import free_port
from tests.testkit.servers import JUDGE_KEY, start_judge

ROOT = Path(__file__).resolve().parents[2]


def run_harness(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``python -m bench.judge_agreement ARGS`` from the repository root, to completion."""
    cmd = [sys.executable, "-m", "bench.judge_agreement", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


HAND_RIGHT = {"correction": 8, "thanks": 8, "tool_success": 10, "tool_error": 7, "ambiguous": 8, "injection": 9}


@pytest.mark.unit
def test_labelled_set_shape() -> None:
    turns = ja.load_turns(ja.DEFAULT_TURNS)
    assert len(turns) == 64 and len({t["id"] for t in turns}) == 64
    assert Counter(t["category"] for t in turns) == {
        "correction": 12,
        "thanks": 10,
        "tool_success": 10,
        "tool_error": 10,
        "ambiguous": 10,
        "injection": 12,
    }
    assert Counter(t["gold"] for t in turns) == {-1: 12 + 10 + 7, 1: 20, 0: 10 + 5}
    assert all(len(t["context"]) == 4 and t["next_state"] for t in turns)


@pytest.mark.unit
def test_pure_figures() -> None:
    ctx = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert [m["content"] for m in ja.perturb_context(ctx)] == ["s", "b", "a", "c"]
    assert ja.perturb_context(ctx[:3]) == ctx[:3]  # nothing to reorder
    assert ja.tie_aware_credit({"status": "tie", "votes": [1, -1, None]}, -1) == 0.5
    assert ja.tie_aware_credit({"status": "tie", "votes": [1, 1, 0, 0, -1]}, -1) == 0.0
    assert ja.tie_aware_credit({"status": "ok", "score": 1, "votes": [1]}, 1) == 1.0
    assert ja.tie_aware_credit({"status": "no_valid_votes", "score": 0, "votes": [None]}, 0) == 0.0
    turns = [
        {"category": "thanks", "gold": 1},
        {"category": "correction", "gold": -1},
        {"category": "ambiguous", "gold": 0},
        {"category": "tool_error", "gold": -1},
    ]
    orig = [
        {
            "prm": {"status": "ok", "score": 1, "votes": [1, 1, 1]},
            "usage": {"engine_calls": 1, "prompt_tokens": 90, "completion_tokens": 30},
        },
        {
            "prm": {"status": "tie", "score": 0, "votes": [1, -1]},
            "usage": {"engine_calls": 1, "prompt_tokens": 90, "completion_tokens": 20},
        },
        {
            "prm": {"status": "no_valid_votes", "score": 0, "votes": [None]},
            "usage": {"engine_calls": 1, "prompt_tokens": 50, "completion_tokens": 10},
        },
        None,
    ]
    pert = [orig[0], {"prm": {"status": "ok", "score": -1, "votes": [-1, -1]}}, orig[2], None]
    f = ja.summarise(turns, orig, pert)
    assert f["accuracy"] == 0.25 and f["tie_aware"] == (1 + 0.5) / 4
    assert f["flip_rate"] == 0.25  # only turn 2: tie -> -1; two failed requests are the same outcome
    assert f["no_valid_rate"] == 0.25 and f["failed_rate"] == 0.25
    assert f["failed_requests"] == 2  # turn 4: no answer, as written nor perturbed
    assert f["votes_per_turn"] == 6 / 4 and f["tokens_per_turn"] == 290 / 4 and f["engine_calls_per_turn"] == 0.75


@pytest.mark.unit
def test_unreachable_judge_is_an_error_not_a_score(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens on the port: every request is a transport error, so the run fails (exit 1) after
    # reporting them, instead of passing off 0.000 accuracy as the judge's figure.
    turns = tmp_path / "turns.jsonl"
    turns.write_text("".join(line + "\n" for line in ja.DEFAULT_TURNS.read_text().splitlines()[:2]))
    out = tmp_path / "figures.json"
    rc = ja.main(["--judge-url", f"http://127.0.0.1:{free_port()}", "--turns", str(turns), "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "16 of 16 judge requests failed" in err and err.count("request failed: ConnectError") == 16
    figures = json.loads(out.read_text())
    assert all(f["failed_requests"] == 4 and f["failed_rate"] == 1.0 and f["accuracy"] == 0.0 for f in figures.values())


@pytest.mark.e2e
def test_harness_against_the_rules_backend(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    env = {"HINDSIGHT_JUDGE_API_KEY": JUDGE_KEY}
    with start_judge(tmp_path, "judge-rules", env=env, ready_path="/ready") as judge:
        res = run_harness("--judge-url", judge.url, "--api-key", JUDGE_KEY, "--json", str(out), timeout_s=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "request failed" not in res.stderr
    figures = json.loads(out.read_text())
    assert list(figures) == ["m=1", "m=3", "m=5", "adaptive"]
    for name, votes in (("m=1", 1), ("m=3", 3), ("m=5", 5), ("adaptive", 3)):
        f = figures[name]
        assert f["turns"] == 64
        assert f["right_by_category"] == HAND_RIGHT, name
        assert f["accuracy"] == f["tie_aware"] == 50 / 64, name
        assert f["flip_rate"] == f["no_valid_rate"] == f["failed_rate"] == f["failed_requests"] == 0, name
        assert f["votes_per_turn"] == votes, name
        assert f["engine_calls_per_turn"] == f["tokens_per_turn"] == 0.0, name
    table = res.stdout.splitlines()
    assert table[0] == (
        "judge agreement on 64 labelled turns: correction 12, thanks 10, tool_success 10, "
        "tool_error 10, ambiguous 10, injection 12"
    )
    assert table[2].split()[:4] == ["m=1", "0.781", "0.781", "0.000"]


@pytest.mark.e2e
def test_harness_starts_an_openai_backend_judge(tmp_path: Path) -> None:
    """``--judge-args`` runs the harness on a judge it starts itself, here the openai backend against a chat
    endpoint without n or constraints (tests/testkit/openai_stub.py) that, once re-asked, always answers +1:
    every setting's accuracy is then exactly the share of +1 gold verdicts, and the line naming the judge
    says which backend was measured."""
    lines = ja.DEFAULT_TURNS.read_text().splitlines()
    picked = [line for c in ja.CATEGORIES for line in [x for x in lines if json.loads(x)["category"] == c][:2]]
    turns = tmp_path / "turns.jsonl"
    turns.write_text("".join(line + "\n" for line in picked))
    gold_plus = sum(json.loads(line)["gold"] == 1 for line in picked)
    key_file = tmp_path / "endpoint.key"
    key_file.write_text("stub-key")
    stub = start_openai_stub(tmp_path, tmp_path / "calls")
    try:
        out = tmp_path / "figures.json"
        judge_args = f"--backend openai --base-url {stub.url}/v1 --model stub-judge --api-key-file {key_file}"
        res = run_harness(
            *("--judge-args", judge_args, "--api-key", JUDGE_KEY, "--turns", str(turns), "--json", str(out)),
            timeout_s=300,
        )
    finally:
        stub.stop()
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"backend openai, endpoint {stub.url}/v1" in res.stdout
    figures = json.loads(out.read_text())
    for name, f in figures.items():
        assert f["turns"] == len(picked) and f["failed_requests"] == 0, name
        assert f["accuracy"] == gold_plus / len(picked), name
        assert f["engine_calls_per_turn"] > f["votes_per_turn"], name  # every vote was asked twice
