"""The end-to-end dev demo: one scripted agent conversation through the whole Hindsight loop.

    python launch/demo.py        (normally `launch/dev.sh demo`; starts the dev stack if needed)

Contract: with the dev stack of ``$HINDSIGHT_RUN_DIR/endpoints.json`` running, drive a
multi-turn agent session through the ``openai`` client against the policy server: the user asks for
the weather, the assistant is made to call ``get_weather`` (``tool_choice`` names the function, which
the policy server turns into constrained decoding; the ids stay the model's own samples), the agent
runs the tool and sends its result, then the user gives feedback, and the last request closes the
session (``X-Session-Done``). Then print, readably: each reply, the judge's votes and verdicts per turn
(and hints in opd/combine), the stored samples, one training step (``hindsight-train --steps 1``) and
the weight update with the engine's new weight version, confirmed by one more chat reply served by the
new weights; finally write the run report (``hindsight-report``: HTML with plots) and print its path. Exits non-zero, saying which step failed, when any step does not complete in time.

The tiny models are random: replies are word salad and an ``llm`` judge's verdicts are random (but
well-formed, constrained by the prompt's regex). The demo shows the mechanics, not quality; use
``JUDGE_BACKEND=rules`` for keyword verdicts that follow the scripted feedback.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import devstack  # (sibling script, not a package)
import httpx

SAMPLES_DEADLINE_S = float(os.environ.get("HINDSIGHT_DEMO_SAMPLES_TIMEOUT_S", "120"))
TRAIN_DEADLINE_S = float(os.environ.get("HINDSIGHT_DEMO_TRAIN_TIMEOUT_S", "300"))
MAX_TOKENS = 24

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        # maxLength: the forced call is typed by this schema, and the tiny dev model rambles in unbounded strings.
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}


def section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def short(text: str | None, n: int = 90) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def run_tool(name: str, arguments: str) -> str:
    """The agent's side of the tool call: a canned weather service."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return json.dumps({"error": f"arguments are not JSON: {arguments!r}"})
    if name != "get_weather":
        return json.dumps({"error": f"unknown tool {name}"})
    return json.dumps({"city": args.get("city", "?"), "forecast": "sunny", "temperature_c": 21})


class Agent:
    """A scripted OpenClaw-style agent: keeps the history and replays it on every request."""

    def __init__(self, endpoints: dict):
        from openai import OpenAI

        self.session_id = "demo-" + uuid.uuid4().hex[:8]
        self.http = httpx.Client(trust_env=False, timeout=httpx.Timeout(120.0, connect=5.0))
        self.client = OpenAI(
            base_url=endpoints["policy_url"] + "/v1", api_key=endpoints["api_key"], http_client=self.http, max_retries=0
        )
        self.messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant with tools."}]

    def send(self, *, done: bool = False, max_tokens: int = MAX_TOKENS, **kwargs) -> dict:
        headers = {"X-Session-Id": self.session_id, "X-Turn-Type": "main"}
        if done:
            headers["X-Session-Done"] = "true"
        resp = self.client.chat.completions.create(
            model="hindsight-policy",
            messages=self.messages,
            tools=[WEATHER_TOOL],
            max_tokens=max_tokens,
            temperature=1.0,
            extra_headers=headers,
            **kwargs,
        )
        msg = resp.choices[0].message
        out: dict = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            out["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in msg.tool_calls
            ]
        meta = (resp.model_extra or {}).get("hindsight") or {}  # Hindsight's own values (CONTRACTS.md)
        self.messages.append(out)
        return {"message": out, "weight_version": meta.get("weight_version"), "finish": resp.choices[0].finish_reason}

    def say(self, role: str, content: str, **extra) -> None:
        self.messages.append({"role": role, "content": content, **extra})
        tag = f"tool:{extra.get('tool_call_id', '')[:8]}" if role == "tool" else role
        print(f"  {tag:>10} | {short(content)}")

    @staticmethod
    def show(reply: dict) -> None:
        m = reply["message"]
        for tc in m.get("tool_calls") or []:
            print(f"  {'assistant':>10} | tool call {tc['function']['name']}({tc['function']['arguments']})")
        if m["content"] or not m.get("tool_calls"):
            print(
                f"  {'assistant':>10} | {short(m['content'])!r}  [finish {reply['finish']}, "
                f"weights v{reply['weight_version']}]"
            )


def converse(agent: Agent) -> int:
    """The scripted session; returns the number of main turns sent."""
    agent.say("user", "What is the weather in Paris today?")
    # Room for the whole constrained <tool_call> block (about 30 tokens for this tokenizer).
    r = agent.send(tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=96)
    agent.show(r)
    if r["message"].get("tool_calls"):
        print(
            f"  {'':>10}   (forced by tool_choice = constrained decoding: the ids are the model's samples, "
            "their log-probs those of the masked distribution)"
        )
    for tc in r["message"].get("tool_calls") or []:
        agent.say("tool", run_tool(tc["function"]["name"], tc["function"]["arguments"]), tool_call_id=tc["id"])
    if not r["message"].get("tool_calls"):
        print("  (no tool call came back although tool_choice named get_weather)")
        agent.say("user", "Please use the get_weather tool.")
    agent.show(agent.send())
    agent.say("user", "Thanks, that worked.")
    agent.show(agent.send())
    agent.say("user", "No, that is wrong. Use the other file.")
    agent.show(agent.send(done=True))
    print(f"  (session {agent.session_id} closed with X-Session-Done: its last turn has no next state)")
    return 4


def admin(endpoints: dict) -> httpx.Client:
    return httpx.Client(
        base_url=endpoints["policy_url"],
        trust_env=False,
        timeout=30.0,
        headers={"Authorization": f"Bearer {endpoints['admin_api_key']}"},
    )


def wait_for_samples(endpoints: dict, session_id: str, expected: int) -> list[dict]:
    """Wait until each of the session's turns has a settled sample (judged: ready, or rejected with a reason)."""
    end = time.monotonic() + SAMPLES_DEADLINE_S
    while True:
        rows = session_samples(endpoints, session_id)
        pending = [r for r in rows if r["status"] == "pending_judge"]
        if len(rows) >= expected and not pending:
            return rows
        if time.monotonic() > end:
            raise SystemExit(
                f"error: {len(rows) - len(pending)} of {expected} turns judged after "
                f"{SAMPLES_DEADLINE_S:.0f}s (see {endpoints['log_dir']}/policy.log and judge.log)"
            )
        time.sleep(0.5)


def session_samples(endpoints: dict, session_id: str) -> list[dict]:
    """The session's sample rows, read through the policy server's non-consuming admin read
    (``GET /v1/samples?session_id=...``: no lease, so the trainer still gets every sample)."""
    with admin(endpoints) as c:
        rows = c.get("/v1/samples", params={"session_id": session_id, "limit": 1000}).raise_for_status().json()
    rows = rows["samples"]
    for r in rows:
        r["sample"] = {**(r.get("sample") or {}), "turn_index": r.get("turn_index")}
    return rows


def stats_of(endpoints: dict) -> dict:
    with admin(endpoints) as c:
        return c.get("/v1/samples/stats").raise_for_status().json()


def ready_count(stats: dict) -> int:
    return int((stats.get("samples") or {}).get("ready", 0))


def show_verdicts(rows: list[dict]) -> None:
    for r in rows:
        prm, hint = r["sample"].get("prm"), r["sample"].get("hint")
        line = f"  turn {r['turn_index']}: "
        if prm:
            line += (
                f"PRM votes {prm.get('votes')} -> score {prm.get('score')} ({prm.get('status')}, "
                f"confidence {prm.get('confidence')})"
            )
        else:
            line += "no PRM verdict"
        if r["status"] == "rejected":
            line += f"  [rejected: {r.get('reject_reason')}]"
        print(line)
        if hint:
            text = repr(short(hint.get("hint"), 60)) if hint.get("accepted") else "none accepted"
            print(f"           hint votes {hint.get('votes')} -> {text} ({hint.get('status')})")


def show_samples(rows: list[dict]) -> None:
    print(
        f"  {'turn':>4} {'status':9} {'mode':7} {'reward':>6} {'teacher':>7} {'prompt':>6} {'resp':>4} "
        f"{'mask':>4} weights"
    )
    for r in rows:
        s = r["sample"]
        print(
            f"  {r['turn_index']:>4} {r['status']:9} {s.get('mode') or '':7} {str(s.get('reward')):>6} "
            f"{'yes' if s.get('has_teacher') else 'no':>7} {len(s.get('prompt_ids') or []):>6} "
            f"{len(s.get('response_ids') or []):>4} {sum(s.get('loss_mask') or []):>4} v{s.get('weight_version')}"
        )
    first = next((r["sample"] for r in rows if r["sample"].get("response_ids")), None)
    if first:
        print(
            f"  e.g. turn {first['turn_index']}: response_ids {first['response_ids'][:8]}... "
            f"rollout_logprobs {[round(x, 2) for x in first['rollout_logprobs'][:4]]}..."
        )


def engine_weight_version(url: str) -> str | None:
    from engine.client import EngineClient

    async def _get() -> str | None:
        client = EngineClient(url)
        try:
            return await client.weight_version()
        finally:
            await client.aclose()

    return asyncio.run(_get())


def next_step(checkpoint_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in checkpoint_dir.glob("step_*") if p.name.split("_")[1].isdigit()]
    return max(steps, default=0) + 1


def train_one_step(endpoints: dict, batch_size: int) -> int | None:
    ckpt = Path(endpoints["checkpoint_dir"])
    step = next_step(ckpt)  # --steps counts across resumes: one more than what is on disk
    cmd = [
        devstack.console_script("hindsight-train"),
        "--policy-url",
        endpoints["policy_url"],
        "--model-path",
        endpoints["policy_model_path"],
        "--out-dir",
        str(ckpt),
        "--steps",
        str(step),
        "--batch-size",
        str(batch_size),
        "--min-batch",
        "1",
        "--lease-wait-s",
        "10",
        "--idle-timeout-s",
        "15",  # a batch without gradient is no step: then the trainer stops once nothing more comes
        "--no-progress",
    ]  # the demo trains on what its session produced
    print(f"  $ HINDSIGHT_TRAIN_ADMIN_API_KEY=*** {' '.join(cmd)}")
    env = {**os.environ, "HINDSIGHT_TRAIN_ADMIN_API_KEY": endpoints["admin_api_key"]}  # never on argv
    log = Path(endpoints["log_dir"]) / "demo-train.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        try:
            res = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=TRAIN_DEADLINE_S, env=env)
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"error: the training step did not finish in {TRAIN_DEADLINE_S:.0f}s (log {log})"
            ) from None
    # The trainer's own summary lines; progress bars and HTTP access lines are in the log.
    lines = [
        ln
        for ln in log.read_text(errors="replace").splitlines()
        if ln.strip() and "Writing model shards" not in ln and "HTTP Request" not in ln
    ]
    for line in lines[-6:]:
        print(f"    {short(line, 150)}")
    if res.returncode != 0:
        raise SystemExit(f"error: hindsight-train exited with {res.returncode} (log {log})")
    if not (ckpt / f"step_{step:06d}").exists():
        print(
            f"  no step: the batch had no gradient (equal rewards against the baseline); {ckpt / 'skipped_steps.jsonl'}"
        )
        return None
    print(f"  trained step {step} in {time.monotonic() - t0:.1f}s; checkpoint {ckpt / f'step_{step:06d}'}")
    return step


def write_run_report(endpoints: dict) -> None:
    """The run report (hindsight-report) of the trainer's out dir plus the stored samples and judge metrics."""
    from trainer.report.cli import write_report

    section("6. run report")
    path = write_report(
        Path(endpoints["checkpoint_dir"]),
        policy_url=endpoints["policy_url"],
        admin_api_key=endpoints["admin_api_key"],
        judge_url=endpoints["judge_url"],
    )
    print(f"  report: {path}")


def main() -> int:
    run_dir = devstack.run_dir_from_env()
    entries = devstack.read_pids(run_dir)
    if not (entries and all(devstack.is_ours(e) for e in entries) and (run_dir / "endpoints.json").exists()):
        section("starting the dev stack")
        devstack.start(run_dir, os.environ.get("MODE") or None, os.environ.get("JUDGE_BACKEND") or None)
    endpoints = json.loads((run_dir / "endpoints.json").read_text())

    section("Hindsight dev demo")
    print(f"  mode {endpoints['mode']}; policy server {endpoints['policy_url']}; judge {endpoints['judge_url']}")
    if endpoints["judge_backend"] == "llm":
        print(
            "  judge backend: llm -- the tiny random judge model votes through the real prompt, engine and\n"
            "  majority vote; its verdicts are random (regex-constrained, so well-formed): mechanics, not quality"
        )
    elif endpoints["judge_backend"] == "openai":
        print(
            "  judge backend: openai -- the same tiny judge model through its router's OpenAI-compatible\n"
            "  /v1/chat/completions (n votes per call, regex where honoured): mechanics, not quality"
        )
    else:
        print("  judge backend: rules -- keyword verdicts from the next state (thanks -> +1, wrong -> -1)")

    section("1. agent conversation through the openai client")
    agent = Agent(endpoints)
    turns = converse(agent)

    section("2. judge votes and verdicts")
    rows = wait_for_samples(endpoints, agent.session_id, turns)
    show_verdicts(rows)

    section("3. stored samples")
    show_samples(rows)
    stats = stats_of(endpoints)
    print(f"  store: {json.dumps(stats['samples'])}; reject reasons {json.dumps(stats.get('reject_reasons'))}")
    if ready_count(stats) == 0:
        raise SystemExit("error: no sample is ready for training (all rejected?); see the table above")

    section("4. one training step")
    before = engine_weight_version(endpoints["policy_engine_url"])
    step = train_one_step(endpoints, batch_size=max(1, ready_count(stats)))

    section("5. weight update")
    after = engine_weight_version(endpoints["policy_engine_url"])
    print(f"  policy engine weight version: {before} -> {after}")
    stats = stats_of(endpoints)
    print(
        f"  policy server: weight_version {stats.get('weight_version')}, weight updates "
        f"{stats.get('weight_updates')}, samples {json.dumps(stats['samples'])}"
    )
    if step is not None and after != str(step):
        raise SystemExit(f"error: the engine reports weight version {after!r}, expected {str(step)!r}")
    agent.messages = agent.messages[:1] + [{"role": "user", "content": "And tomorrow?"}]
    agent.session_id = "demo-" + uuid.uuid4().hex[:8]
    reply = agent.send(done=True)
    print(f"  a new request is served by weights v{reply['weight_version']}: {short(reply['message']['content'])!r}")
    write_run_report(endpoints)
    section("done")
    print(f"  logs: {endpoints['log_dir']}   stop the stack: launch/dev.sh stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
