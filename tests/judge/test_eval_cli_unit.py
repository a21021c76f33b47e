"""hindsight-judge-eval without a judge: the (turn, next_state) split, the request body, the prediction mode end to
end through ``main()`` (table, JSON, HTML with one confusion matrix per source), bad input (exit 2), and the HTTP
client's retry rules and per-step cache against an ``httpx.MockTransport`` judge.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from judge_server.eval import cli
from judge_server.eval.dataset import load_dataset, load_predictions, split_steps
from judge_server.eval.metrics import score
from judge_server.eval.run import JudgeTarget, final_step_marker, judge_steps, request_body
from judge_server.guards import GUARD_RULES
from judge_server.schemas import JudgeRequest

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "agentprocessbench"
CALL = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "question"},
    {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [CALL]},
    {"role": "tool", "name": "search", "tool_call_id": "c1", "content": "result"},
    {"role": "system", "content": "reminder"},
    {"role": "assistant", "content": "<answer>A</answer>"},
]
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def test_split_into_turn_and_next_state() -> None:
    first, last = split_steps(9, MESSAGES, {2: 1, 5: -1}, TOOLS)
    assert first.key == (9, 2) and first.label == 1
    assert [m["role"] for m in first.context] == ["system", "user"]
    assert first.response == {"content": "", "reasoning_content": "think", "tool_calls": [CALL]}
    # tool results keep their name and call id; any other role becomes the user's side
    assert first.next_state == (
        {"role": "tool", "name": "search", "tool_call_id": "c1", "content": "result"},
        {"role": "user", "content": "reminder"},
    )
    assert first.has_next_state and first.tools == tuple(TOOLS)
    assert len(last.context) == 5 and last.next_state == () and not last.has_next_state


def test_request_body_final_step_rules() -> None:
    first, last = split_steps(9, MESSAGES, {2: 1, 5: -1}, TOOLS)
    body = request_body(first, 3, "marker")
    assert body is not None and body["tasks"] == ["prm"] and body["m"] == 3
    assert body["next_state"][0]["tool_call_id"] == "c1"
    assert ("tools" in body) == ("tools" in JudgeRequest.model_fields)
    final = request_body(last, 3, "marker")
    assert final is not None and final["next_state"] == [{"role": "user", "content": final_step_marker()}]
    assert "episode ended" in final_step_marker().lower() or "end of episode" in final_step_marker().lower()
    assert request_body(last, 3, "skip") is None


def test_every_dataset_step_makes_a_valid_request() -> None:
    steps = load_dataset(DATA / "hotpotqa.dev.jsonl")
    assert len(steps) == 597
    assert all(request_body(s, 3, "marker") is not None for s in steps)
    assert sum(request_body(s, 3, "skip") is None for s in steps) == sum(not s.has_next_state for s in steps) > 0


def test_predictions_mode_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted((DATA / "predictions").glob("*.dev.jsonl"))[:2]
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    argv = [str(DATA / "hotpotqa.dev.jsonl"), "--predictions", *map(str, files), "--bootstrap", "50"]
    assert cli.main([*argv, "--json", str(out_json), "--html", str(out_html)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    names = [s["name"] for s in report["sources"]]
    assert names == [cli.BASE_RATE, cli.GUARDS_SOURCE, *(f.name.removesuffix(".dev.jsonl") for f in files)]
    steps = load_dataset(DATA / "hotpotqa.dev.jsonl")
    for f, source in zip(files, report["sources"][2:], strict=True):
        expected = score(steps, load_predictions(f).labels)
        assert source["macro_f1"] == pytest.approx(expected.macro_f1)
        assert source["kappa"] == pytest.approx(expected.kappa)
        assert source["confusion"]["counts"] == [list(r) for r in expected.confusion]
        assert f"{expected.accuracy:.3f}" in printed
        lo, hi = source["macro_f1_ci95"]
        assert lo <= source["macro_f1"] <= hi
    assert [g["rule"] for g in report["guards"]] == list(GUARD_RULES) and "implied" in printed
    page = out_html.read_text()
    assert page.count("<figure class='confusion'><svg") == len(names)
    assert "missing" in page and "predicted" in page and all(n in page for n in names[2:])
    assert "<script" not in page and "src=" not in page  # one self-contained file


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.jsonl"], "cannot read"),
        (["{data}", "--predictions", "{data}.nope"], "cannot read"),
        (["{data}", "--predictions", "{bad}"], "not 1, 0, -1 or null"),
        (["{data}", "--judge-url", "ftp://x"], "http(s) URL"),
        (["{data}", "--votes", "0"], "at least 1"),
        (["{data}", "--final-step", "maybe"], "invalid choice"),
    ],
)
def test_bad_input_exits_2(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"index_in_dataset": 0, "step_labels": {"2": 5}}) + "\n")
    data = str(DATA / "hotpotqa.dev.jsonl")
    args = [a.format(data=data, bad=bad) for a in argv]
    try:
        code = cli.main([*args, "--no-guards", "--bootstrap", "0"])
    except SystemExit as exc:
        code = exc.code  # argparse's own errors
    assert code == 2
    assert message in capsys.readouterr().err


class FakeJudge:
    """A /v1/judge behind httpx.MockTransport: scripted answers per (trajectory, first context text) call count."""

    def __init__(self, script: list[httpx.Response | Exception]):
        self.script = script
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True, "backend": "fake", "prompt_versions": {"prm": "p@1"}})
        self.calls += 1
        item = self.script[min(self.calls - 1, len(self.script) - 1)]
        if isinstance(item, Exception):
            raise item
        return item


def _ok(score_: int | None, status: str = "ok") -> httpx.Response:
    return httpx.Response(200, json={"prm": {"score": score_, "status": status, "votes": []}})


def _run(steps: list[Any], judge: FakeJudge, cache: Path, **target: Any) -> Any:
    t = JudgeTarget(url="http://judge", initial_backoff_s=0.01, max_backoff_s=0.02, step_deadline_s=5, **target)
    return asyncio.run(judge_steps(steps, t, cache, progress=False, transport=httpx.MockTransport(judge)))


def test_client_retries_5xx_429_and_transport_errors_never_other_4xx(tmp_path: Path) -> None:
    steps = split_steps(1, MESSAGES, {2: 1}, TOOLS)
    judge = FakeJudge([httpx.Response(503), httpx.ConnectError("down"), httpx.Response(429), _ok(-1)])
    run = _run(steps, judge, tmp_path / "c.jsonl", concurrency=1)
    assert judge.calls == 4 and run.verdicts[0].score == -1 and run.info.backend == "fake"
    judge = FakeJudge([httpx.Response(422, json={"detail": "no"}), _ok(1)])
    run = _run(steps, judge, tmp_path / "d.jsonl", concurrency=1)
    assert judge.calls == 1 and run.verdicts[0].score is None and run.verdicts[0].status == "http_422"


def test_no_verdict_statuses_and_the_cache(tmp_path: Path) -> None:
    steps = split_steps(1, MESSAGES, {2: 1, 5: -1}, TOOLS)
    cache = tmp_path / "c.jsonl"
    judge = FakeJudge([_ok(None, "tie")])
    first = _run(steps, judge, cache, concurrency=1)
    assert [v.status for v in first.verdicts] == ["tie", "tie"] and all(v.score is None for v in first.verdicts)
    assert judge.calls == 2 and first.sent == 2 and len(cache.read_text().splitlines()) == 2
    again = _run(steps, FakeJudge([_ok(1)]), cache, concurrency=1)  # answered from the cache: nothing sent
    assert again.sent == 0 and again.from_cache == 2 and again.verdicts == first.verdicts
    other_m = FakeJudge([_ok(1)])
    assert [v.score for v in _run(steps, other_m, cache, m=5).verdicts] == [1, 1] and other_m.calls == 2
    # a judge_failed answer is not cached: the next run asks again
    failed = tmp_path / "f.jsonl"
    _run(steps, FakeJudge([_ok(None, "judge_failed")]), failed)
    assert not failed.read_text()
    skipped = _run(steps, FakeJudge([_ok(1)]), tmp_path / "s.jsonl", final_step="skip")
    assert [v.status for v in skipped.verdicts] == ["ok", "skipped"] and skipped.sent == 1
