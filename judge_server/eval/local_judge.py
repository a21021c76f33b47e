"""A judge server started for one measurement run: ``hindsight-judge`` with the caller's arguments on loopback.

Role: lets one command measure a judge that is not running yet (``hindsight-judge-eval --judge-args "..."``,
``bench.judge_agreement --judge-args "..."``): e.g. ``--backend openai --base-url URL --model NAME
--api-key-file F`` measures any OpenAI-compatible endpoint. The server binds 127.0.0.1 on a free port (the
caller's ``--host``/``--port`` are overridden: the arguments are followed by ours, and the last flag wins), is
ready when its ``/ready`` answers 200 (for ``openai``: the endpoint's ``/v1/models`` answered), logs to a
temporary folder whose tail is shown if it fails to start, and is stopped (only that process) when the
context ends.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from engine.procs import free_port, start_process
from judge_server.eval.run import EvalRunError

START_DEADLINE_S = 120.0  # the judge loads its tokenizer and checks its endpoint before /ready answers


@contextlib.contextmanager
def local_judge(judge_args: str, api_key: str | None = None, deadline_s: float = START_DEADLINE_S) -> Iterator[str]:
    """The URL of a ``hindsight-judge`` started with ``judge_args`` (a shell-quoted string), stopped on exit;
    EvalRunError when it does not become ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "judge_server.cli", *shlex.split(judge_args), "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    env = {"HINDSIGHT_JUDGE_API_KEY": api_key} if api_key else None
    with tempfile.TemporaryDirectory(prefix="hindsight-eval-judge-") as logs:
        try:
            judge = start_process(
                "judge",
                cmd,
                url=f"http://127.0.0.1:{port}",
                log_dir=Path(logs),
                ready_path="/ready",
                env=env,
                deadline_s=deadline_s,
            )
        except RuntimeError as exc:  # not ready in time: the message holds its log tail
            raise EvalRunError(f"the judge started with {judge_args!r} did not become ready: {exc}") from exc
        try:
            yield judge.url
        finally:
            judge.stop()
