"""SGLang conformance: every body the judge and the policy server send to an engine is one SGLang 0.5.23 accepts.

An e2e run (real processes on 127.0.0.1: a dev engine recording every POST body it receives, see
devkit/dev_server/recording.py; the LLM judge with constrained votes on it; the policy server in
``combine`` mode on it, with the same engine as teacher and a rules-backend judge, whose verdicts on
the tiny model's replies are decided, so a turn gets a hint and is teacher-scored) exercises what the
services send:
chat turns with sampling options, streaming, a forced tool call (ebnf), a JSON response format
(ebnf of its schema) with logit_bias and top log-probs, judge votes (``n`` > 1, regex),
teacher scoring with top-K log-probs, a weight update (pause -> update_weights_from_disk -> continue) and a
client hang-up (abort_request). The recorded bodies then go, as JSON, to tests/conformance/sglang_validate.py
run by the separate SGLang venv's python (tests/conformance/make_sglang_venv.sh), which checks each with
SGLang's own classes: ``generate_contract_error``, ``GenerateReqInput(...).normalize_batch_and_arguments()``,
``SamplingParams(...).normalize(tokenizer)`` + ``.verify(vocab_size)``, and the control request structs.

The recorder is generic: a sampling parameter or endpoint the services start sending is validated without
touching this test; a path the validator does not know fails it. The test also asserts that the run really
covered each feature above, so it cannot pass by recording nothing.

Skipped (with the reason) when the SGLang venv is not there: CI builds it (.ci/run); locally run
``bash tests/conformance/make_sglang_venv.sh`` once (4-7 minutes, 6 GB, reused afterwards).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine
from tests.testkit.servers import ADMIN_KEY, CLIENT_KEY, start_judge, start_llm_judge, start_policy
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = Path(__file__).parent
LONG = 3000  # max_tokens of the request whose client hangs up (EOS banned): far more than the time it is given
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move_file",
            "description": "Rename a file",
            "parameters": {
                "type": "object",
                "properties": {"src": {"type": "string"}, "dst": {"type": "string"}},
                "required": ["src", "dst"],
            },
        },
    }
]


def sglang_venv() -> Path:
    return Path(os.environ.get("HINDSIGHT_SGLANG_VENV", Path.home() / ".cache" / "hindsight" / "sglang-0.5.23"))


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    venv = sglang_venv()
    if not (venv / ".complete").exists():
        failed = venv.with_name(venv.name + ".failed")
        why = failed.read_text().strip() if failed.exists() else "not built"
        pytest.skip(
            f"SGLang 0.5.23 venv unavailable at {venv} ({why}); "
            "build it with: bash tests/conformance/make_sglang_venv.sh"
        )
    return venv / "bin" / "python"


@dataclass
class Stack:
    engine: ManagedProcess
    judge: ManagedProcess
    rules_judge: ManagedProcess
    policy: ManagedProcess
    record_path: Path

    def records(self) -> list[dict[str, Any]]:
        if not self.record_path.exists():
            return []
        return [json.loads(ln) for ln in self.record_path.read_text().splitlines() if ln.strip()]

    def wait_record(self, pred, what: str, deadline_s: float = 30.0) -> dict[str, Any]:
        hits = wait_until(
            lambda: [r for r in self.records() if pred(r)],
            timeout_s=deadline_s,
            message=f"the engine never received {what}",
        )
        return hits[-1]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("conformance")
    record_path = d / "engine-requests.jsonl"
    engine = start_dev_engine(
        tiny_model_dir,
        log_dir=d,
        extra_args=["--seed", "0", "--weight-version", "v0", "--record-requests", str(record_path)],
    )
    policy = rules_judge = judge = None
    try:
        judge = start_llm_judge(
            d,
            engine.url,
            tiny_model_dir,
            m=3,
            args=["--constrain-output", "--max-new-tokens", "8", "--request-deadline-s", "30"],
        )
        rules_judge = start_judge(d, "rules-judge", m=3)
        policy = start_policy(
            tiny_model_dir,
            engine.url,
            d / "data",
            d,
            extra=[
                "--judge-url",
                rules_judge.url,
                "--teacher-url",
                engine.url,
                "--mode",
                "combine",
                "--teacher-top-k",
                "4",
                "--session-idle-timeout-s",
                "2",
                "--idle-sweep-interval-s",
                "0.2",
            ],
        )
        yield Stack(engine, judge, rules_judge, policy, record_path)
    finally:
        for mp in (policy, rules_judge, judge, engine):
            if mp is not None:
                mp.stop()


def _chat(stack: Stack, sid: str, body: dict[str, Any], done: bool = False) -> dict[str, Any]:
    headers = {
        "Authorization": f"Bearer {CLIENT_KEY}",
        "X-Session-Id": sid,
        **({"X-Session-Done": "true"} if done else {}),
    }
    r = httpx.post(stack.policy.url + "/v1/chat/completions", json=body, headers=headers, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(stack: Stack, sid: str, body: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": sid, "X-Session-Done": "true"}
    with httpx.stream(
        "POST",
        stack.policy.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=120,
        trust_env=False,
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def _stats(stack: Stack) -> dict[str, Any]:
    r = httpx.get(
        stack.policy.url + "/v1/samples/stats",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
        trust_env=False,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _hang_up(stack: Stack, eos_id: int) -> None:
    """A client that leaves mid-generation: the policy server must abort the engine request."""
    # EOS banned: a greedy tiny model may otherwise end its "long" answer before the client leaves.
    body = {
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": LONG,
        "temperature": 0,
        "logit_bias": {str(eos_id): -100},
    }

    async def run() -> None:
        async with httpx.AsyncClient(
            base_url=stack.policy.url, trust_env=False, timeout=60, headers={"Authorization": f"Bearer {CLIENT_KEY}"}
        ) as ac:
            task = asyncio.create_task(
                ac.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "conf-hangup"})
            )
            await asyncio.to_thread(
                stack.wait_record,
                lambda r: (
                    r["path"] == "/generate"
                    and isinstance(r["body"].get("sampling_params"), dict)
                    and r["body"]["sampling_params"].get("max_new_tokens") == LONG
                ),
                "the long generation",
            )
            assert not task.done(), "the long generation finished before the client could leave"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    stack.wait_record(lambda r: r["path"] == "/abort_request", "/abort_request after the client left")


def _drive(stack: Stack, model_dir: Path) -> None:
    hello = [{"role": "user", "content": "Rename a.txt to b.txt"}]
    first = _chat(
        stack,
        "conf-plain",
        {
            "messages": hello,
            "max_tokens": 6,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": ["\n\n", "END"],
            "seed": 3,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
        },
    )
    reply = first["choices"][0]["message"]
    _chat(
        stack,
        "conf-plain",
        {
            "messages": [
                *hello,
                {"role": "assistant", "content": reply["content"] or ""},
                {"role": "user", "content": "that is wrong, rename it to c.txt"},
            ],
            "max_tokens": 4,
        },
        done=True,
    )
    _stream(stack, "conf-stream", {"messages": hello, "max_tokens": 5, "stream_options": {"include_usage": True}})
    _chat(
        stack,
        "conf-tool",
        {
            "messages": hello,
            "max_tokens": 48,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "move_file"}},
        },
        done=True,
    )
    _chat(
        stack,
        "conf-json",
        {
            "messages": hello,
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
            "logit_bias": {"5": -3.5},
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "r",
                    "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
                },
            },
        },
        done=True,
    )
    # The LLM judge's constrained votes (prm and hint, n = m per round) on the recording engine.
    judged = httpx.post(
        stack.judge.url + "/v1/judge",
        timeout=120,
        trust_env=False,
        json={
            "context": hello,
            "response": {"content": "Done."},
            "tasks": ["prm", "hint"],
            "m": 3,
            "next_state": [{"role": "user", "content": "that is wrong, rename it to c.txt"}],
        },
    )
    assert judged.status_code == 200, judged.text
    # Teacher scoring runs once the turn is paired and judged (a hint accepted): wait for the dispatcher.
    wait_until(
        lambda: (st := _stats(stack))["samples"].get("ready", 0) >= 1 and st["samples"].get("pending_judge", 0) == 0,
        timeout_s=90,
        interval_s=0.2,
        message=lambda: f"no sample was judged and teacher-scored in time: {_stats(stack)}",
    )
    r = httpx.post(
        stack.policy.url + "/admin/weights/update",
        json={"model_path": str(model_dir), "weight_version": "v1"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=120,
        trust_env=False,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    _hang_up(stack, json.loads((model_dir / "config.json").read_text())["eos_token_id"])


def _sampling_params(body: dict[str, Any]) -> list[dict[str, Any]]:
    sp = body.get("sampling_params") or {}
    return [p for p in (sp if isinstance(sp, list) else [sp]) if isinstance(p, dict)]


def _stop_table(records: list[dict[str, Any]], model_dir: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    stops: set[str] = set()
    for rec in records:
        if rec["path"] == "/generate":
            for sp in _sampling_params(rec["body"]):
                stop = sp.get("stop") or []
                stops.update([stop] if isinstance(stop, str) else stop)
    return {s: tok.encode(s, add_special_tokens=False) for s in stops}


def test_every_engine_body_is_accepted_by_sglang(sglang_python: Path, stack: Stack, tiny_model_dir: Path) -> None:
    _drive(stack, tiny_model_dir)
    records = stack.records()
    generates = [r["body"] for r in records if r["path"] == "/generate"]
    params = [sp for body in generates for sp in _sampling_params(body)]
    covered = {
        "judge votes (n > 1)": any((sp.get("n") or 1) > 1 for sp in params),
        "regex constraint": any(sp.get("regex") for sp in params),
        "ebnf constraint (forced tool call)": any("<tool_call>" in (sp.get("ebnf") or "") for sp in params),
        "ebnf constraint (JSON response format)": any(
            sp.get("ebnf") and "<tool_call>" not in sp["ebnf"] for sp in params
        ),
        "logit_bias": any(sp.get("logit_bias") for sp in params),
        "output top log-probs": any(
            b.get("top_logprobs_num", 0) > 0 and any((sp.get("max_new_tokens") or 0) > 0 for sp in _sampling_params(b))
            for b in generates
        ),
        "teacher top-K scoring": any(
            b.get("top_logprobs_num", 0) > 0 and any(sp.get("max_new_tokens") == 0 for sp in _sampling_params(b))
            for b in generates
        ),
        "streaming": any(b.get("stream") is True for b in generates),
        "logprobs": any(b.get("return_logprob") is True for b in generates),
        "stop strings": any(sp.get("stop") for sp in params),
        **{
            path: any(r["path"] == path for r in records)
            for path in ("/pause_generation", "/update_weights_from_disk", "/continue_generation", "/abort_request")
        },
    }
    assert all(covered.values()), f"the run did not cover: {[k for k, v in covered.items() if not v]}"

    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    task = {"vocab_size": vocab_size, "stop_token_ids": _stop_table(records, tiny_model_dir), "records": records}
    proc = subprocess.run(
        [str(sglang_python), str(HERE / "sglang_validate.py")],
        input=json.dumps(task),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(records)
    failed = [{**res, "body": records[res["index"]]["body"]} for res in results if not res["ok"]]
    assert not failed, "SGLang 0.5.23 rejects bodies the services sent:\n" + "\n".join(
        f"{f['path']}: {f['error']}\n  body: {json.dumps(f['body'])[:600]}" for f in failed
    )
