"""Property-based requests against each server's own OpenAPI (schemathesis, fixed seed, bounded examples):
no 5xx on any route, and every answer matches the documented status codes, content types and bodies.

Real servers on loopback ports: the policy server (in front of the real dev engine) and the judge (rules
backend). Hypothesis is derandomized (a fixed seed per test) and each route gets at most ``EXAMPLES``
examples, so the two tests run in about 1.5 minutes on 2 cores. Generated chat bodies are capped at 8 new tokens
(the tiny CPU model would otherwise spend seconds per example on the largest ``max_tokens``), and lease waits
are capped by ``--max-lease-wait-s 1``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from policy_testkit import ADMIN_KEY, CLIENT_KEY, start_policy
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from engine.procs import ManagedProcess, free_port, start_process

pytestmark = pytest.mark.e2e
EXAMPLES = 10
JUDGE_KEY = "judge-key"


def not_a_server_error(ctx, response, case) -> bool:
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
    return True


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def policy(
    tiny_model_dir: Path, engine: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    d = tmp_path_factory.mktemp("schemathesis-policy")
    mp = start_policy(tiny_model_dir, engine.url, d / "data", d, extra=["--max-lease-wait-s", "1"])
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "judge_server.cli", "--backend", "rules", "--port", str(port), "--api-key", JUDGE_KEY]
    mp = start_process(
        "judge", cmd, url=f"http://127.0.0.1:{port}", log_dir=tmp_path_factory.mktemp("judge"), deadline_s=60
    )
    yield mp
    mp.stop()


HYPOTHESIS = settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


def _fuzz(url: str, key_for) -> dict[str, list[int]]:
    """Every operation of ``url``'s OpenAPI, EXAMPLES derandomized cases each; the statuses answered per
    operation (``"POST /v1/judge": [200, 400, ...]``).

    (One hypothesis run per operation inside the test, rather than schemathesis' pytest parametrization,
    whose lazy fixture loader does not support this pytest version.)"""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    done: dict[str, list[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        done[f"{op.method.upper()} {op.path}"] = []

        @HYPOTHESIS
        @given(case=op.as_strategy())
        def run(case) -> None:
            _cap_generation(case)
            response = case.call_and_validate(
                base_url=url, headers={"Authorization": f"Bearer {key_for(case.path)}"}, checks=CHECKS, timeout=60
            )
            done[f"{case.method.upper()} {case.path}"].append(response.status_code)

        run()
    return done


def _cap_generation(case) -> None:
    if case.path == "/v1/responses" and isinstance(case.body, dict):
        case.body["max_output_tokens"] = min(case.body.get("max_output_tokens") or 8, 8)
    if case.path == "/v1/messages" and isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = min(case.body["max_tokens"], 8)
    if case.path == "/v1/chat/completions" and isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int):
                case.body[key] = min(case.body[key], 8)
        if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = 8


def test_policy_openapi(policy):
    ops = _fuzz(policy.url, lambda path: ADMIN_KEY if path.startswith(("/v1/samples", "/admin")) else CLIENT_KEY)
    print({op: sorted(set(s)) for op, s in ops.items()})
    # The documented schemas are exact enough that generated data reaches the success paths.
    assert 200 in ops["POST /v1/chat/completions"] and 200 in ops["GET /v1/samples/lease"]


def test_judge_openapi(judge):
    ops = _fuzz(judge.url, lambda _path: JUDGE_KEY)
    print({op: sorted(set(s)) for op, s in ops.items()})
    assert 200 in ops["POST /v1/judge"]
