"""hindsight-judge-eval against real judge servers on 127.0.0.1 (tests.testkit): a slice of AgentProcessBench's steps.

- Rules backend (deterministic): every step of the slice comes back ``ok`` and the figures equal those of the
  rules judge's own verdicts (judge_server.rules.RuleJudge on the request's next state, computed here); the
  judge's backend and prompt versions are reported; ``--final-step skip`` reports the final steps as missing.
- Resume: a run of 4 steps, then one of 10 on the same cache sends only the 6 new steps (the judge's own
  request counter on ``/metrics``), and its figures equal an uncached run's.
- The tiny LLM judge on a CPU dev engine, as the dev stack runs it (m=3): every step gets a judge status and the figures are consistent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.model_cache import copy_of
from judge_server.eval import cli
from judge_server.eval.dataset import load_dataset
from judge_server.eval.metrics import score
from judge_server.eval.run import request_body
from judge_server.rules import RuleJudge
from judge_server.settings import DEFAULT_NEGATIVE, DEFAULT_POSITIVE
from launch.devstack import DEV_JUDGE_ENV
from tests.testkit import cached_models
from tests.testkit.openai_stub import start_openai_stub
from tests.testkit.procs import ManagedProcess, metric_value
from tests.testkit.servers import JUDGE_KEY, llm_judge_stack, start_judge

pytestmark = pytest.mark.e2e

DATASET = Path(__file__).resolve().parents[2] / "bench" / "data" / "agentprocessbench" / "hotpotqa.dev.jsonl"


@pytest.fixture(scope="module")
def keyed_rules_judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_judge(tmp_path_factory.mktemp("eval-rules"), args=["--api-key", JUDGE_KEY]) as judge:
        yield judge


def judge_requests(judge: ManagedProcess) -> float:
    return metric_value(judge.url, "hindsight_judge_http_requests_total", route="/v1/judge", method="POST")


def run_eval(judge_url: str, out: Path, *args: str) -> dict[str, Any]:
    argv = [str(DATASET), "--judge-url", judge_url, "--judge-api-key", JUDGE_KEY, "--json", str(out)]
    assert cli.main([*argv, "--bootstrap", "20", "--no-guards", "--no-progress", *args]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def judge_source(report: dict[str, Any]) -> dict[str, Any]:
    source: dict[str, Any] = report["sources"][-1]
    assert source["name"].startswith("judge ")
    return source


def test_rules_judge_slice(keyed_rules_judge: ManagedProcess, tmp_path: Path) -> None:
    report = run_eval(keyed_rules_judge.url, tmp_path / "r.json", "--votes", "1", "--limit", "8")
    judged = judge_source(report)
    assert judged["statuses"] == {"ok": 8} and judged["missing"] == 0
    assert report["judge"]["backend"] == "rules" and report["judge"]["prompt_versions"]["prm"].startswith("rules@")
    assert report["judge"]["final_step"].startswith("eval_episode_end_v1@") and report["judge"]["sent"] == 8
    # what the rules judge says of each request's next state, computed here
    steps = load_dataset(DATASET)[:8]
    rules = RuleJudge(DEFAULT_POSITIVE, DEFAULT_NEGATIVE)
    expected = {}
    for step in steps:
        body = request_body(step, 1, "marker")
        assert body is not None
        expected[step.key] = rules.prm_verdict(body["next_state"])
    want = score(steps, expected)
    assert judged["confusion"]["counts"] == [list(r) for r in want.confusion]
    assert (judged["accuracy"], judged["macro_f1"]) == pytest.approx((want.accuracy, want.macro_f1))
    assert judged["first_error_accuracy"] == pytest.approx(want.first_error_accuracy)

    skipped = judge_source(
        run_eval(keyed_rules_judge.url, tmp_path / "s.json", "--votes", "1", "--limit", "8", "--final-step", "skip")
    )
    finals = sum(1 for s in steps if not s.has_next_state)
    assert finals > 0 and skipped["statuses"] == {"ok": 8 - finals, "skipped": finals} and skipped["missing"] == finals


def test_resume_sends_only_new_steps(keyed_rules_judge: ManagedProcess, tmp_path: Path) -> None:
    cache = tmp_path / "steps.jsonl"
    before = judge_requests(keyed_rules_judge)
    first = run_eval(keyed_rules_judge.url, tmp_path / "a.json", "--limit", "4", "--cache", str(cache))
    assert judge_requests(keyed_rules_judge) - before == 4 and first["judge"]["sent"] == 4
    # a killed run leaves a torn last line: it is ignored, the complete lines count
    with cache.open("a") as f:
        f.write('{"key": "torn')
    before = judge_requests(keyed_rules_judge)
    resumed = run_eval(keyed_rules_judge.url, tmp_path / "b.json", "--limit", "10", "--cache", str(cache))
    assert judge_requests(keyed_rules_judge) - before == 6
    assert (resumed["judge"]["sent"], resumed["judge"]["from_cache"]) == (6, 4)
    before = judge_requests(keyed_rules_judge)
    fresh = run_eval(
        keyed_rules_judge.url, tmp_path / "c.json", "--limit", "10", "--cache", str(tmp_path / "fresh.jsonl")
    )
    assert judge_requests(keyed_rules_judge) - before == 10
    for key in ("accuracy", "macro_f1", "kappa", "first_error_accuracy", "confusion", "statuses", "macro_f1_ci95"):
        assert judge_source(resumed)[key] == judge_source(fresh)[key], key
    # another m is another request: nothing cached applies
    before = judge_requests(keyed_rules_judge)
    run_eval(keyed_rules_judge.url, tmp_path / "d.json", "--limit", "4", "--cache", str(cache), "--votes", "2")
    assert judge_requests(keyed_rules_judge) - before == 4


@pytest.mark.slow
def test_tiny_llm_judge_slice(tmp_path: Path) -> None:
    # The dev stack's judge model and settings: its context holds the trajectories' search results (the suite's
    # tiny policy has too short a context, and every long step would end judge_failed).
    model = copy_of(cached_models.dev_teacher(), tmp_path / "judge-model")
    args = ["--api-key", JUDGE_KEY, "--log-level", "warning"]
    with llm_judge_stack(model, tmp_path, m=3, args=args, env=DEV_JUDGE_ENV) as stack:
        report = run_eval(stack.judge.url, tmp_path / "r.json", "--votes", "3", "--limit", "6")
    judged = judge_source(report)
    assert report["judge"]["backend"] == "llm" and report["judge"]["prompt_versions"]["prm"].startswith("prm_eval")
    assert sum(judged["statuses"].values()) == 6
    assert set(judged["statuses"]) <= {"ok", "tie", "no_valid_votes"}  # constrained votes parse; the engine is up
    assert judged["missing"] == 6 - judged["statuses"].get("ok", 0)
    assert sum(map(sum, judged["confusion"]["counts"])) == 6


def test_one_command_measures_an_openai_compatible_endpoint(tmp_path: Path) -> None:
    """``--judge-args`` starts the judge for the run: here the openai backend on a chat endpoint that answers
    one choice without constraints and, once re-asked, always ``\\boxed{1}`` (tests/testkit/openai_stub.py). Every
    step is then +1, so the judge's figures are exactly the base rate's on the slice, its backend is reported as
    openai, the endpoint really saw the judge's prompts, and the started judge is gone afterwards."""
    import httpx

    key_file = tmp_path / "endpoint.key"
    key_file.write_text("stub-key")
    calls = tmp_path / "calls.jsonl"
    stub = start_openai_stub(tmp_path, calls)
    out = tmp_path / "openai.json"
    judge_args = f"--backend openai --base-url {stub.url}/v1 --model stub-judge --api-key-file {key_file}"
    try:
        argv = [str(DATASET), "--judge-args", judge_args, "--votes", "1", "--limit", "6", "--json", str(out)]
        assert cli.main([*argv, "--bootstrap", "0", "--no-guards", "--no-progress"]) == 0
    finally:
        stub.stop()
    report = json.loads(out.read_text())
    base, judged = report["sources"][0], judge_source(report)
    assert report["judge"]["backend"] == "openai" and judged["statuses"] == {"ok": 6}
    assert judged["confusion"]["counts"] == base["confusion"]["counts"]
    assert (judged["accuracy"], judged["kappa"]) == (base["accuracy"], base["kappa"])
    prompts = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(prompts) >= 6 and all(p["model"] == "stub-judge" for p in prompts)
    with pytest.raises(httpx.TransportError):  # the judge it started was stopped
        httpx.get(report["judge"]["url"] + "/health", timeout=2)
