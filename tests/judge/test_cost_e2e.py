"""End-to-end judge cost: hindsight-judge (real process) -> one CPU dev engine, tokenizer ids.

Contract (judge_server/judge.py "One prefill per turn" and "Cost"; CONTRACTS "Judge service"): with both tasks
the judge prefills the prompts' common prefix once (max_new_tokens=0), so each task's own call finds it in the
engine's prefix cache. Each task result records ``engine_calls``, ``prompt_tokens``, ``cached_tokens``,
``completion_tokens``, equal to what the engine reports in meta_info for the ids the judge renders (checked here
by rendering the same ids); ``usage`` is their sum; ``/metrics`` has ``hindsight_judge_tokens_total`` and
``hindsight_judge_tokens_per_turn`` by task and kind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.chat import load_tokenizer, render_prompt_ids
from prompts import TokenCounter, load_template, render_judge_messages
from tests.testkit.procs import ManagedProcess, metric_value
from tests.testkit.servers import llm_judge_stack

pytestmark = pytest.mark.e2e
MAX_NEW = 12


@pytest.fixture(scope="module")
def judge(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    args = ["--max-new-tokens", str(MAX_NEW), "--log-level", "warning"]
    with llm_judge_stack(tiny_model_dir, tmp_path_factory.mktemp("judge-cost"), args=args) as s:
        yield s.judge


def test_cost_fields_match_engine_prefill(judge: ManagedProcess, tiny_model_dir: Path) -> None:
    tag = uuid.uuid4().hex  # a context no earlier prompt shares, so the only cache hits are this item's
    req = {
        "context": [{"role": "user", "content": f"[{tag}] Please rename report.txt to summary.txt in ~/docs."}],
        "response": {"content": "Renamed it."},
        "next_state": [{"role": "user", "content": "No, that is the wrong folder; use ~/work."}],
        "tasks": ["prm", "hint"],
        "m": 3,
    }
    r = httpx.post(judge.url + "/v1/judge", json=req, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    body = r.json()

    tok = load_tokenizer(str(tiny_model_dir))
    ids = {}
    for task, name in (("prm", "prm_eval_v2"), ("hint", "hint_extract_v2")):
        messages, _ = render_judge_messages(
            load_template(name),
            context=req["context"],
            response=req["response"],
            next_state=req["next_state"],
            counter=TokenCounter.from_tokenizer(tok),
            context_budget_tokens=3000,
            part_budget_tokens=2000,
        )
        ids[task] = render_prompt_ids(tok, messages)
    shared = len(os.path.commonprefix([ids["prm"], ids["hint"]]))
    assert shared >= 0.75 * min(len(v) for v in ids.values())  # short context: the question is a larger share

    prm, hint = body["prm"], body["hint"]
    assert prm["status"] != "judge_failed" and hint["status"] != "judge_failed"
    # prm carries the shared-prefix call (fresh: nothing cached) and its own call (the prefix cached)
    assert (prm["engine_calls"], prm["prompt_tokens"], prm["cached_tokens"]) == (2, shared + len(ids["prm"]), shared)
    assert (hint["engine_calls"], hint["prompt_tokens"], hint["cached_tokens"]) == (1, len(ids["hint"]), shared)
    for res in (prm, hint):
        assert len(res["votes"]) == 3 and 3 <= res["completion_tokens"] <= 3 * MAX_NEW
    keys = ("engine_calls", "prompt_tokens", "cached_tokens", "completion_tokens")
    assert body["usage"] == {k: prm[k] + hint[k] for k in keys}
    # prefilled tokens: one prefix + two tails, instead of two whole prompts
    prefilled = body["usage"]["prompt_tokens"] - body["usage"]["cached_tokens"]
    assert prefilled == shared + (len(ids["prm"]) - shared) + (len(ids["hint"]) - shared)

    assert metric_value(judge.url, "hindsight_judge_tokens_total", task="hint", kind="cached") >= shared
    assert metric_value(judge.url, "hindsight_judge_tokens_per_turn_count", task="prm", kind="prompt") >= 1
    assert metric_value(judge.url, "hindsight_judge_votes_per_turn_count", task="prm") >= 1
