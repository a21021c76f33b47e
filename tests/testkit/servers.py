"""The services as tests start them, and the small HTTP helpers every test area shares.

One set of test keys (``CLIENT_KEY`` for agents, ``ADMIN_KEY`` for the trainer and operators, ``JUDGE_KEY``
for a keyed judge, ``ENGINE_KEY`` for a keyed engine), one ``start_judge`` and one ``start_policy``
(subprocesses on 127.0.0.1 ephemeral ports, tied to this process by tests.testkit.procs) with the variants
tests share, ``judged_policy_stack`` for a policy server scored by the rules judge, and the clients tests use.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tests.testkit.procs import (
    ManagedProcess,
    async_http_client,
    free_port,
    http_client,
    start_dev_engine,
    start_process,
    start_router,
)
from tests.waiting import wait_until

if TYPE_CHECKING:  # the store loads only where a test reads one
    from policy_server.store import SampleStore
    from policy_server.store.records import SampleRow

ADMIN_KEY = "admin-secret"
CLIENT_KEY = "client-secret"
JUDGE_KEY = "judge-key"  # what a policy server sends a keyed judge (--judge-api-key)
ENGINE_KEY = "engine-secret"  # a keyed engine's client key (its admin key is ADMIN_KEY)
TEST_MODEL_ALIAS = "m"  # the model name the policy tests' clients send (a client with a name of its own)
REPO_ROOT = Path(__file__).resolve().parents[2]


def policy_command(model_dir: str | Path, engine_url: str, *args: str) -> list[str]:
    """``python -m policy_server.cli`` serving ``model_dir`` through ``engine_url``, then ``args``."""
    return [
        sys.executable,
        "-m",
        "policy_server.cli",
        "--model-path",
        str(model_dir),
        "--engine-url",
        engine_url,
        *args,
    ]


def start_policy(
    model_dir: Path,
    engine_url: str,
    data_dir: Path,
    log_dir: Path,
    *,
    name: str = "policy",
    extra: list[str] | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    client_key: str | None = CLIENT_KEY,
    fail_fast: bool = True,
) -> ManagedProcess:
    """A real policy server on 127.0.0.1, ready: the admin key ``ADMIN_KEY``, the client key ``client_key``
    (None: no client auth), the model alias ``TEST_MODEL_ALIAS``. ``fail_fast`` bounds an engine call at
    10 s and 3 tries (fault tests see the failure quickly); ``extra`` comes last, so it overrides."""
    port = port or free_port()
    args = ["--data-dir", str(data_dir), "--host", "127.0.0.1", "--port", str(port), "--admin-api-key", ADMIN_KEY]
    if client_key is not None:
        args += ["--api-key", client_key]
    if fail_fast:
        args += ["--engine-deadline-s", "10", "--engine-max-attempts", "3"]
    cmd = policy_command(model_dir, engine_url, *args, "--model-aliases", TEST_MODEL_ALIAS, *(extra or []))
    return start_process(name, cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir, env=env, deadline_s=60)


def start_routed_policy(
    model_dir: Path, router: ManagedProcess, engine: ManagedProcess, work: Path, *, extra: Sequence[str] = ()
) -> ManagedProcess:
    """``start_policy`` -> ``router`` -> ``engine`` (data in ``work/data``); weight sync goes to the engine itself."""
    args = ["--engine-worker-urls", engine.url, *extra]
    return start_policy(model_dir, router.url, work / "data", work, extra=args)


def start_judged_policy(
    model_dir: Path,
    engine_url: str,
    judge_url: str,
    data_dir: Path,
    log_dir: Path,
    *,
    name: str = "policy",
    teacher_url: str | None = None,
    extra: Sequence[str] = (),
    **options: Any,
) -> ManagedProcess:
    """``start_policy`` judged by ``judge_url``, its judge calls retried quickly (at most 1 s apart) and, when given,
    scored by the OPD teacher at ``teacher_url``; its data folder is ``extra["data_dir"]``. ``extra`` comes last;
    ``options`` are start_policy's (``client_key``, ``fail_fast``, ``port``, ``env``)."""
    args = ["--judge-url", judge_url, "--dispatch-retry-max-s", "1"]
    if teacher_url is not None:
        args += ["--teacher-url", teacher_url]
    mp = start_policy(model_dir, engine_url, data_dir, log_dir, name=name, extra=[*args, *extra], **options)
    mp.extra["data_dir"] = data_dir
    return mp


def start_prm_policy(
    model_dir: Path,
    engine: ManagedProcess,
    judge: ManagedProcess,
    data_dir: Path,
    log_dir: Path,
    name: str,
    prm_config: Path | None,
    *,
    port: int | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """``start_judged_policy`` with a first dispatch retry after 0.2 s and, when given, the PRM scorers of
    ``prm_config``; ``extra`` comes last."""
    args = ["--dispatch-retry-initial-s", "0.2"]
    if prm_config is not None:
        args += ["--prm-config", str(prm_config)]
    return start_judged_policy(
        model_dir, engine.url, judge.url, data_dir, log_dir, name=name, extra=[*args, *extra], port=port, env=env
    )


def pythonpath_with_repo() -> dict[str, str]:
    """Env for a server process that must import test modules by dotted path (``tests.…`` test scorers)."""
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(REPO_ROOT) + (os.pathsep + old if old else "")}


def judge_command(
    port: int,
    *,
    backend: str | None = None,
    engine_url: str | None = None,
    tokenizer_path: str | Path | None = None,
    m: int | None = None,
    args: Sequence[str] = (),
) -> list[str]:
    """``python -m judge_server.cli`` on 127.0.0.1:``port``; each option is passed only when given."""
    cmd = [sys.executable, "-m", "judge_server.cli", "--host", "127.0.0.1", "--port", str(port)]
    if backend is not None:
        cmd += ["--backend", backend]
    if engine_url is not None:
        cmd += ["--engine-url", engine_url]
    if tokenizer_path is not None:
        cmd += ["--tokenizer-path", str(tokenizer_path)]
    if m is not None:
        cmd += ["--m", str(m)]
    return [*cmd, *args]


def start_judge(
    log_dir: Path,
    name: str = "judge",
    *,
    backend: str | None = "rules",
    engine_url: str | None = None,
    tokenizer_path: str | Path | None = None,
    m: int | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    port: int | None = None,
    ready_path: str | None = None,
    deadline_s: float = 60,
) -> ManagedProcess:
    """A real judge server, ready. The default is the deterministic rules backend ("thanks"/"worked" +1,
    "wrong"/"No," -1); with ``engine_url`` it is the LLM backend (pass ``backend=None`` to keep the
    service's default) and readiness is ``/ready`` (the engine reachable), else ``/health``."""
    port = port or free_port()
    cmd = judge_command(port, backend=backend, engine_url=engine_url, tokenizer_path=tokenizer_path, m=m, args=args)
    ready = ready_path or ("/ready" if engine_url else "/health")
    url = f"http://127.0.0.1:{port}"
    return start_process(name, cmd, url=url, log_dir=log_dir, env=env, ready_path=ready, deadline_s=deadline_s)


def start_llm_judge(log_dir: Path, engine_url: str, tokenizer_path: str | Path, **options: Any) -> ManagedProcess:
    """``start_judge`` with the service's default (LLM) backend on ``engine_url``, ready on ``/ready``;
    ``options`` are start_judge's (``m``, ``args``, ``env``, ...)."""
    return start_judge(log_dir, backend=None, engine_url=engine_url, tokenizer_path=tokenizer_path, **options)


def start_openai_judge(log_dir: Path, name: str, *args: str) -> ManagedProcess:
    """``start_judge`` with the ``openai`` backend (its endpoint and key in ``args``), ready on ``/ready`` (the
    endpoint answers)."""
    return start_judge(log_dir, name, backend="openai", args=args, ready_path="/ready")


def start_failing_judge(
    log_dir: Path, name: str, *, args: Sequence[str] = (), env: dict[str, str] | None = None
) -> ManagedProcess:
    """An LLM judge whose engine is down (nothing listens on its port): m=1 and a 1 s deadline, so every item
    ends ``judge_failed`` quickly (a real failing dependency, not a fake)."""
    dead = f"http://127.0.0.1:{free_port()}"
    failing = ["--engine-url", dead, "--m", "1", "--request-deadline-s", "1", *args]
    return start_judge(log_dir, name, backend=None, args=failing, env=env, ready_path="/health")


@contextmanager
def judged_policy_stack(
    model_dir: Path, engine_url: str, work: Path, extra: list[str] | None = None
) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    """A policy server judged by a rules-backend judge (its default settings); yields (policy, judge), stops both."""
    judge = start_judge(work)
    pol = None
    try:
        pol = start_policy(model_dir, engine_url, work / "data", work, extra=["--judge-url", judge.url, *(extra or [])])
        yield pol, judge
    finally:
        if pol:
            pol.stop()
        judge.stop()


def samples_of(store: SampleStore, session_id: str) -> list[SampleRow]:
    """The stored sample rows of one session in turn order (``sample``: the Sample JSON as stored)."""
    return store.list_samples(session_id=session_id, limit=100_000)


def prm_pair(**over: Any) -> dict[str, Any]:
    """A /v1/judge body: one short turn, a thankful next state, the PRM task with one vote (``over`` replaces keys)."""
    body = {
        "context": [{"role": "user", "content": "Rename a.txt to b.txt"}],
        "response": {"content": "Done."},
        "next_state": [{"role": "user", "content": "thanks, it worked"}],
        "tasks": ["prm"],
        "m": 1,
    }
    return {**body, **over}


def stored_samples(data_dir: str | Path, session_id: str) -> list[SampleRow]:
    """:func:`samples_of` read from a stopped (or killed) policy server's store folder, opened and closed here."""
    from policy_server.store import Store

    store = Store(str(data_dir))
    try:
        return samples_of(store, session_id)
    finally:
        store.close()


def stats_once(url: str, key: str, *, timeout_s: float = 60.0) -> dict:
    """The policy server's sample stats once ``stats[key]`` is truthy (AssertionError with the last stats)."""
    wait_until(lambda: stats(url)[key], timeout_s=timeout_s, interval_s=0.1, message=lambda: stats(url))
    return stats(url)


def chat(url: str, sid: str, messages: list[dict], *, max_tokens: int, done: bool = False) -> dict:
    """One main turn of session ``sid``; returns the assistant message."""
    headers = {"X-Session-Id": sid, **({"X-Session-Done": "true"} if done else {})}
    with client(url) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def stats(url: str) -> dict:
    with admin(url) as c:
        r = c.get("/v1/samples/stats")
    assert r.status_code == 200, r.text
    return r.json()


def lease_all(url: str) -> dict:
    """Lease (and ack) every ready sample; returns the lease answer."""
    with admin(url) as c:
        r = c.get("/v1/samples/lease", params={"max": 256, "wait_s": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        if body["lease_id"]:
            assert c.post("/v1/samples/ack", json={"lease_id": body["lease_id"]}).status_code == 200
    return body


def of_session(samples: list[dict], sid: str) -> dict[int, dict]:
    return {s["turn_index"]: s for s in samples if s["session_id"] == sid}


def ready_status(url: str) -> int:
    """The status code of ``url``'s ``/ready`` (a connection error propagates)."""
    with http_client(timeout=10) as c:
        return c.get(url + "/ready").status_code


def admin(url: str) -> httpx.Client:
    return http_client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def client(url: str) -> httpx.Client:
    return http_client(base_url=url, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60)


def policy_data_dir(policy: ManagedProcess) -> Path:
    """The data folder of a policy server started with its data beside its log (``d / "data"``)."""
    return policy.log_path.parent / "data"


def openai_client(url: str, *, timeout_s: float = 60, headers: dict[str, str] | None = None) -> Any:
    """The real openai SDK client of the policy server at ``url`` (client key, no retries, no proxy)."""
    import openai

    return openai.OpenAI(
        base_url=url + "/v1",
        api_key=CLIENT_KEY,
        max_retries=0,
        timeout=timeout_s,
        default_headers=headers,
        http_client=http_client(timeout=timeout_s),
    )


def async_openai_client(url: str, *, timeout_s: float = 120) -> Any:
    """``openai_client``'s asyncio twin (for agent frameworks that take an AsyncOpenAI)."""
    import openai

    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=CLIENT_KEY,
        max_retries=0,
        timeout=timeout_s,
        http_client=async_http_client(timeout=timeout_s),
    )


# One tool the policy tests offer the model: a small schema with a bounded string (forced calls end quickly).
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
            },
        },
    }
]


@dataclass
class JudgeStack:
    """An LLM judge on dev engines: ``engines``, the ``router`` in front of them (None with one engine), and the
    ``judge`` whose engine URL is the router's (else the engine's)."""

    engines: list[ManagedProcess]
    router: ManagedProcess | None
    judge: ManagedProcess

    def router_generate_count(self) -> int:
        """The router's count of ``POST /generate`` requests (its Prometheus counter)."""
        assert self.router is not None, "a stack without a router counts nothing"
        with http_client() as c:
            text = c.get(f"http://127.0.0.1:{self.router.extra['prometheus_port']}/metrics").text
        m = re.search(r'smg_http_requests_total\{method="POST",path="/generate"\} (\d+)', text)
        return int(m.group(1)) if m else 0

    def post(self, path: str, body: dict, timeout_s: float = 60.0) -> httpx.Response:
        with http_client(timeout=timeout_s) as c:
            return c.post(self.judge.url + path, json=body)


@contextmanager
def llm_judge_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    engines: int = 1,
    engine_api_key: str | None = None,
    **judge_options: Any,
) -> Iterator[JudgeStack]:
    """``engines`` dev engines on ``model_dir`` (started in parallel; keyed with ``engine_api_key``), a real
    sglang-router in front of them when there is more than one, and ``start_llm_judge`` on them with
    ``judge_options`` (``m``, ``args``, ``env``, ...); everything is stopped on exit, the judge first."""
    started: list[ManagedProcess] = []
    try:
        with ThreadPoolExecutor(engines) as pool:  # leaving the block waits for every start
            futures = [
                pool.submit(start_dev_engine, model_dir, log_dir=log_dir, name=f"engine{i}", api_key=engine_api_key)
                for i in range(engines)
            ]
        started += [f.result() for f in futures if f.exception() is None]
        failures = [exc for f in futures if (exc := f.exception()) is not None]
        if failures:  # the engines that did start are stopped below
            raise failures[0]
        router = None
        if engines > 1:
            router = start_router([e.url for e in started], log_dir=log_dir)
            started.append(router)
        judge = start_llm_judge(log_dir, (router or started[0]).url, model_dir, **judge_options)
        started.append(judge)
        yield JudgeStack(started[:engines], router, judge)
    finally:
        for proc in reversed(started):
            proc.stop()
