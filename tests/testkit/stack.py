"""The whole stack for end-to-end tests, and its scripted user.

``start_stack`` starts, on 127.0.0.1 ephemeral ports: a dev engine on a private COPY of the tiny model
(weight updates load checkpoints, but the copy keeps the shared fixture untouched), the judge server with
the rules backend (m=1), and the policy server in mode rl (optionally with ``--prm-config``). Every process
is stopped by its process group in ``Stack.stop`` (and dies with the test run: tests.testkit.procs).

``ScriptedUser`` drives sessions through the policy server with the openai client. Its next message is
"Thanks, that worked." when the assistant's reply contains the target, "No, that is wrong." otherwise, so
the rules judge's verdict on each paired turn is a deterministic reward (+1 / -1) for the target. The last
feedback is sent with ``X-Session-Done`` and max_tokens 1: it pairs the previous turn and closes the session
(the closing turn itself is rejected ``no_next_state``, as it has no next state).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.testkit.procs import ManagedProcess, http_client, spawn, start_dev_engine
from tests.testkit.servers import ADMIN_KEY, openai_client, start_judge, start_policy

GOOD, BAD = "Thanks, that worked.", "No, that is wrong."


@dataclass
class Stack:
    model_dir: Path
    engine: ManagedProcess
    judge: ManagedProcess
    policy: ManagedProcess
    procs: list[ManagedProcess] = field(default_factory=list)
    prm_config: Path | None = None

    def admin(self) -> httpx.Client:
        return http_client(base_url=self.policy.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)

    def stats(self) -> dict:
        with self.admin() as a:
            r = a.get("/v1/samples/stats")
            r.raise_for_status()
            return r.json()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in self.procs)


def judged_rl_args(judge_url: str) -> list[str]:
    """The policy server's flags for a judged rl stack that pairs and retries quickly (idle sessions close after
    30 s, swept every 0.2 s; a failed judge dispatch retried after 0.1 s)."""
    return [
        "--judge-url",
        judge_url,
        "--mode",
        "rl",
        "--session-idle-timeout-s",
        "30",
        "--idle-sweep-interval-s",
        "0.2",
        "--dispatch-retry-initial-s",
        "0.1",
    ]


def start_stack(
    tiny_model_dir: Path,
    work: Path,
    *,
    prm_yaml: str | None = None,
    engine_seed: int = 0,
    copy_model: bool = True,
    policy_args: Sequence[str] = (),
) -> Stack:
    """``prm_yaml``: PRM config text for ``--prm-config``; ``{judge_url}`` in it becomes the judge's URL.
    The written file is ``Stack.prm_config`` (the trainer reads the same file). ``copy_model=False`` serves
    the given folder itself (for a stack whose weights are never updated from disk); ``policy_args`` come
    last on the policy server's command line, so they override the stack's own."""
    model_dir = work / "policy-model"
    if copy_model:
        shutil.copytree(tiny_model_dir, model_dir)
    else:
        model_dir = tiny_model_dir
    logs = work / "logs"
    procs: list[ManagedProcess] = []
    try:
        engine = start_dev_engine(model_dir, log_dir=logs, extra_args=["--seed", str(engine_seed)])
        procs.append(engine)
        judge = start_judge(logs, m=1)
        procs.append(judge)
        extra = [*judged_rl_args(judge.url), "--log-level", "WARNING"]
        prm_config = None
        if prm_yaml is not None:
            prm_config = work / "prm.yaml"
            prm_config.write_text(prm_yaml.replace("{judge_url}", judge.url))
            extra += ["--prm-config", str(prm_config)]
        policy = start_policy(model_dir, engine.url, work / "data", logs, extra=[*extra, *policy_args], fail_fast=False)
        procs.append(policy)
    except Exception as exc:
        tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)
        for p in reversed(procs):
            p.stop()
        raise RuntimeError(f"stack failed: {exc}\n{tails}") from None
    return Stack(model_dir=model_dir, engine=engine, judge=judge, policy=policy, procs=procs, prm_config=prm_config)


class ScriptedUser:
    """Sessions through the policy server's OpenAI API; feedback depends only on ``is_good(reply)``."""

    def __init__(
        self,
        policy_url: str,
        is_good: Callable[[str], bool],
        *,
        max_tokens: int,
        workers: int = 4,
        pause_s: float = 0.0,
    ):
        self.client = openai_client(policy_url)
        self.is_good = is_good
        self.max_tokens = max_tokens
        self.workers = workers
        self.pause_s = pause_s  # think time after each reply (traffic shape, not synchronisation)

    def _chat(self, messages: list[dict], sid: str, seed: int, max_tokens: int, done: bool = False) -> str:
        headers = {"X-Session-Id": sid, **({"X-Session-Done": "true"} if done else {})}
        r = self.client.chat.completions.create(
            model="hindsight-policy",
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            extra_headers=headers,
        )
        if self.pause_s:
            time.sleep(self.pause_s)
        return r.choices[0].message.content or ""

    def session(self, sid: str, prompt: str, turns: int, seed: int) -> list[bool]:
        """One session of ``turns`` judged turns; returns whether each reply contained the target."""
        messages = [{"role": "user", "content": prompt}]
        outcomes = []
        for t in range(turns):
            reply = self._chat(messages, sid, seed * 1000 + t, self.max_tokens)
            good = self.is_good(reply)
            outcomes.append(good)
            messages = [
                *messages,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": GOOD if good else BAD},
            ]
        self._chat(messages, sid, seed * 1000 + turns, 1, done=True)  # pairs the last turn and closes the session
        return outcomes

    def run(self, prefix: str, prompts: list[str], turns: int, seed: int) -> list[bool]:
        """One session per prompt, ``workers`` at a time; the judged outcomes of all turns."""
        with ThreadPoolExecutor(self.workers) as pool:
            futs = [pool.submit(self.session, f"{prefix}-{i}", p, turns, seed + i) for i, p in enumerate(prompts)]
            return [o for f in futs for o in f.result()]

    def close(self) -> None:
        self.client.close()


# ----------------------------------------------------------------------------- the trickle closed loop
@dataclass
class TrickleRun:
    """One trickle closed loop: what the trainer logged and when the traffic ended."""

    rc: int
    metrics: list[dict]  # metrics.jsonl, one record per optimizer step
    skipped: list[dict]  # skipped_steps.jsonl, one record per batch without gradient
    outcomes: list[bool]  # whether each judged user turn contained the target
    traffic_end_version: int  # the trainer's last published step when the user's last session ended
    traffic_s: float
    log_tail: str

    @property
    def sample_versions(self) -> list[str]:
        """The distinct weight versions the trained samples were generated by (initial weights: 'default')."""
        versions = {v for m in self.metrics for v in m["weight_versions"]}
        return sorted(versions, key=lambda v: (v.isdigit(), int(v) if v.isdigit() else 0, v))

    def versions_made_during_traffic(self) -> list[str]:
        """Trained-sample versions that the trainer itself published while the user was still sending traffic."""
        return [v for v in self.sample_versions if v.isdigit() and 0 < int(v) <= self.traffic_end_version]

    def max_staleness(self) -> int:
        """The largest age (in weight versions) of a trained sample, over all steps."""
        ages = [m["step"] - 1 - (int(v) if v.isdigit() else 0) for m in self.metrics for v in m["weight_versions"]]
        return max(ages, default=0)


def run_trickle(
    stack: Stack,
    out: Path,
    trainer_args: list[str],
    *,
    sessions: int,
    turns: int,
    is_good: Callable[[str], bool],
    prompts: list[str],
    max_tokens: int,
    pause_s: float = 0.05,
    seed: int = 500,
    trainer_timeout_s: float = 300.0,
    after_session: Callable[[int], None] | None = None,
) -> TrickleRun:
    """Sessions ONE AT A TIME through the policy server while ``hindsight-train`` (a subprocess, leasing over
    HTTP with ``trainer_args`` on top of the loop's fixed flags) trains, checkpoints and pushes weights; the
    trainer stops on its idle timeout after the traffic. Every published version is seen by later sessions.
    ``after_session(n)`` runs after the n-th session."""
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "--policy-url",
        stack.policy.url,
        "--model-path",
        str(stack.model_dir),
        "--out-dir",
        str(out),
        "--steps",
        "100000",
        "--keep-checkpoints",
        "1",
        "--no-progress",
        "--no-sync-on-resume",
        *trainer_args,
    ]
    env = {"OMP_NUM_THREADS": "1", "HINDSIGHT_TRAIN_ADMIN_API_KEY": ADMIN_KEY}
    trainer = spawn(out.name, cmd, url="", log_dir=out.parent, env=env).proc  # its log: ``log``
    user = ScriptedUser(stack.policy.url, is_good, max_tokens=max_tokens, workers=1, pause_s=pause_s)
    outcomes: list[bool] = []
    try:
        # The traffic starts once the trainer is up (it writes config.json after its imports, just before it
        # loads the policy): a trainer that joins after the traffic would train only the initial weights' samples.
        deadline = time.monotonic() + trainer_timeout_s
        while not (out / "config.json").exists():
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        started = time.monotonic()
        for i in range(sessions):
            outcomes += user.session(f"{out.name}-{i}", prompts[i % len(prompts)], turns, seed=seed + i)
            if after_session is not None:
                after_session(i + 1)  # e.g. a held-out measurement while the trainer keeps running
        traffic_s = time.monotonic() - started
        with stack.admin() as a:  # the engine's version now = the trainer's last publish during the traffic
            version = str(a.get("/v1/samples/stats").json().get("weight_version"))
        rc = trainer.wait(timeout=trainer_timeout_s)
    finally:
        user.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []  # noqa: E731
    return TrickleRun(
        rc=rc,
        metrics=read(out / "metrics.jsonl"),
        skipped=read(out / "skipped_steps.jsonl"),
        outcomes=outcomes,
        traffic_end_version=int(version) if version.isdigit() else 0,
        traffic_s=traffic_s,
        log_tail=log.read_text(errors="replace")[-4000:],
    )
