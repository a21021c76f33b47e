"""The judge's reward-client routes as OpenRLHF and slime see them, end to end (real judge processes).

Contract (judge_server/compat.py, docs/CONTRACTS.md "Reward clients"):
- ``/get_reward`` answers numbers only: ``rewards``/``scores`` floats and every ``extra_logs`` value a list
  of floats, so both generations of OpenRLHF's remote reward client turn it into tensors.
- A ``judge_failed`` item is answered 503 so the client's own retry path runs (and finally raises), or,
  with ``--compat-failed-reward F``, ``F`` flagged ``judge_failed: 1.0``; never ``null``, never a silent 0.
- ``/slime/reward`` answers ``{"reward": float, ...}``, read by slime with ``--reward-key reward``.
- Both routes take the judge key as the URL query parameter ``api_key`` (OpenRLHF and slime send no
  header); the key is in no log line and no metric label.
- examples/reward_clients.py (the guide's example, docs/REWARD_CLIENTS.md) runs as written and prints the
  rewards the rules backend decides; without the key it exits non-zero with the 401, never a reward.

The clients below reproduce, in our own words, the response handling of those frameworks' remote reward
functions (read from their public sources): OpenRLHF posts ``{"query", "prompts", "labels"}``, calls
``raise_for_status`` and retries any failure a few times with a short sleep before raising; its earlier
versions read ``response["rewards"]`` into one tensor, its 2025 versions turn ``rewards``, ``scores`` and
every ``extra_logs`` value into tensors. slime posts ``{"prompt", "response", "label"}`` per sample,
retries any failure (4xx included) with capped exponential backoff, then raises; the reward is
``response[reward_key]`` with ``--reward-key``, else the whole JSON body.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.records import JudgeVerdicts
from judge_server.compat import openrlhf_reply, slime_reply
from judge_server.errors import RewardUnavailable
from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import JUDGE_KEY as KEY
from tests.testkit.servers import start_failing_judge, start_judge

PROMPTS = ["Q: rename a.txt to b.txt\nA:", "Q: delete the logs\nA:"]
QUERIES = [PROMPTS[0] + " Done, renamed.", PROMPTS[1] + " Deleted everything."]
LABELS = ["thanks, it worked", "that is wrong, I said the logs only"]


class ClientGaveUp(Exception):
    """What the frameworks' clients raise once their retries are spent."""


# ------------------------------------------------------------------------ the clients, in our own words
def openrlhf_post(url: str, body: dict[str, Any], tries: int = 3) -> tuple[dict[str, Any], int]:
    """POST, raise_for_status, retry any failure with a short sleep; (JSON body, attempts) or ClientGaveUp."""
    for attempt in range(1, tries + 1):
        try:
            r = httpx.post(url, json=body, timeout=60, trust_env=False)
            r.raise_for_status()
            return r.json(), attempt
        except (httpx.HTTPError, ValueError):
            time.sleep(0.05)
    raise ClientGaveUp(f"no reward after {tries} attempts")


def openrlhf_classic(url: str, queries: list[str], prompts: list[str], labels: list[str]) -> torch.Tensor:
    """Earlier OpenRLHF: the ``rewards`` list becomes one tensor."""
    body, _ = openrlhf_post(url, {"query": queries, "prompts": prompts, "labels": labels})
    assert "rewards" in body, body
    return torch.tensor(body["rewards"])


def openrlhf_2025(url: str, queries: list[str], prompts: list[str], labels: list[str]) -> dict[str, Any]:
    """2025 OpenRLHF: rewards, scores (default: rewards) and every extra_logs value become tensors."""
    body, attempts = openrlhf_post(url, {"query": queries, "prompts": prompts, "labels": labels})
    rewards = torch.tensor(body["rewards"])
    return {
        "rewards": rewards,
        "scores": torch.tensor(body.get("scores", body["rewards"])),
        "extra_logs": {k: torch.tensor(v) for k, v in body.get("extra_logs", {}).items()},
        "attempts": attempts,
    }


async def slime_remote_rm(url: str, sample: dict[str, Any], reward_key: str | None, max_retries: int = 3) -> Any:
    """slime's remote rm: retry every failure (4xx too) with capped backoff, then raise."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for attempt in range(max_retries):
            try:
                r = await http.post(url, json=sample)
                r.raise_for_status()
                body = r.json()
                return body[reward_key] if reward_key else body
            except httpx.HTTPError as exc:
                if attempt + 1 >= max_retries:
                    raise ClientGaveUp(str(exc)) from exc
                await asyncio.sleep(min(0.05 * 2**attempt, 0.2))
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------ pure shaping (hand-derived)
def _result(status: str, score: int | None, confidence: float) -> JudgeVerdicts:
    return JudgeVerdicts.model_validate(
        {
            "prm": {"score": score, "status": status, "votes": [], "confidence": confidence, "reason": "x"},
            "prompt_versions": {"prm": "prm_eval_v1@abc"},
        }
    )


@pytest.mark.unit
def test_openrlhf_reply_is_numbers_only() -> None:
    results = [_result("ok", 1, 1.0), _result("tie", 0, 0.5), _result("no_valid_votes", 0, 0.0)]
    reply = openrlhf_reply(results, failed_reward=None)
    assert reply.rewards == [1.0, 0.0, 0.0] and reply.scores == [1.0, 0.0, 0.0]
    assert reply.extra_logs == {
        "judge_ok": [1.0, 0.0, 0.0],
        "judge_tie": [0.0, 1.0, 0.0],
        "judge_no_valid_votes": [0.0, 0.0, 1.0],
        "judge_failed": [0.0, 0.0, 0.0],
        "judge_abstained": [0.0, 0.0, 0.0],
        "judge_quarantined": [0.0, 0.0, 0.0],
        "judge_confidence": [1.0, 0.5, 0.0],
    }


@pytest.mark.unit
def test_guarded_items_are_a_flagged_neutral_never_a_503() -> None:
    """A guard's verdict without a score (abstained, quarantined) is answered 0.0 with its status flagged,
    like no_valid_votes: a deterministic rule would answer the same to a retry, so no 503."""
    results = [_result("ok", 1, 1.0), _result("abstained", None, 0.0), _result("quarantined", None, 0.0)]
    reply = openrlhf_reply(results, failed_reward=None)
    assert reply.rewards == [1.0, 0.0, 0.0]
    assert reply.extra_logs["judge_abstained"] == [0.0, 1.0, 0.0]
    assert reply.extra_logs["judge_quarantined"] == [0.0, 0.0, 1.0]
    assert reply.extra_logs["judge_ok"] == [1.0, 0.0, 0.0]
    slime = slime_reply(results[2], failed_reward=None)
    assert (slime.reward, slime.status, slime.confidence) == (0.0, "quarantined", 0.0)


@pytest.mark.unit
def test_failed_item_is_503_or_the_configured_fallback() -> None:
    results = [_result("ok", -1, 2 / 3), _result("judge_failed", None, 0.0)]
    with pytest.raises(RewardUnavailable) as err:
        openrlhf_reply(results, failed_reward=None)
    assert err.value.status_code == 503
    reply = openrlhf_reply(results, failed_reward=0.25)
    assert reply.rewards == [-1.0, 0.25]
    assert reply.extra_logs["judge_failed"] == [0.0, 1.0] and reply.extra_logs["judge_confidence"][1] == 0.0
    with pytest.raises(RewardUnavailable):
        slime_reply(results[1], failed_reward=None)
    assert slime_reply(results[1], failed_reward=-0.5).reward == -0.5
    assert slime_reply(results[0], failed_reward=None).reward == -1.0


# ------------------------------------------------------------------------ end to end
JUDGE_ENV = {"HINDSIGHT_JUDGE_API_KEY": KEY, "HINDSIGHT_JUDGE_LOG_JSON": "1"}


@pytest.fixture(scope="module")
def rules_judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """A keyed judge with the rules backend: deterministic verdicts from the next state's wording."""
    log_dir = tmp_path_factory.mktemp("judge-rules")
    with start_judge(log_dir, "judge-rules", args=["--log-level", "debug"], env=JUDGE_ENV) as judge:
        yield judge


@pytest.fixture(scope="module")
def failing_judges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    """Two LLM judges whose engine is down (nothing listens on its port): without and with the fallback."""
    log_dir = tmp_path_factory.mktemp("judge-failing")
    fallback_args = ["--compat-failed-reward", "0.0"]
    with (
        start_failing_judge(log_dir, "judge-503", env=JUDGE_ENV) as plain,
        start_failing_judge(log_dir, "judge-fallback", args=fallback_args, env=JUDGE_ENV) as fallback,
    ):
        yield plain, fallback


@pytest.mark.e2e
def test_openrlhf_clients_of_both_generations_read_the_reply(rules_judge: ManagedProcess) -> None:
    url = f"{rules_judge.url}/get_reward?api_key={KEY}"
    assert openrlhf_classic(url, QUERIES, PROMPTS, LABELS).tolist() == [1.0, -1.0]
    out = openrlhf_2025(url, QUERIES, PROMPTS, LABELS)
    assert out["rewards"].tolist() == [1.0, -1.0] and out["scores"].tolist() == [1.0, -1.0]
    assert out["extra_logs"]["judge_ok"].tolist() == [1.0, 1.0]
    assert out["extra_logs"]["judge_failed"].tolist() == [0.0, 0.0]
    assert all(t.dtype.is_floating_point for t in out["extra_logs"].values())


@pytest.mark.e2e
def test_query_key_is_required_checked_and_header_still_works(rules_judge: ManagedProcess) -> None:
    body = {"query": QUERIES[:1], "prompts": PROMPTS[:1], "labels": LABELS[:1]}
    for path in ("/get_reward", "/get_reward?api_key=wrong-key", "/slime/reward?api_key="):
        r = httpx.post(rules_judge.url + path, json=body, trust_env=False, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "Unauthorized"
    with pytest.raises(ClientGaveUp):  # a 401 is retried by the client, then it gives up: never a reward
        openrlhf_classic(rules_judge.url + "/get_reward?api_key=wrong-key", QUERIES, PROMPTS, LABELS)
    r = httpx.post(
        rules_judge.url + "/get_reward",
        json=body,
        trust_env=False,
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and r.json()["rewards"] == [1.0]
    # The query parameter is for the reward-client routes only.
    judge_body = {
        "context": [{"role": "user", "content": "hi"}],
        "response": {"content": "hello"},
        "next_state": [{"role": "user", "content": "thanks"}],
        "tasks": ["prm"],
    }
    r = httpx.post(f"{rules_judge.url}/v1/judge?api_key={KEY}", json=judge_body, trust_env=False, timeout=30)
    assert r.status_code == 401


@pytest.mark.e2e
def test_slime_reads_the_reward_with_reward_key(rules_judge: ManagedProcess) -> None:
    url = f"{rules_judge.url}/slime/reward?api_key={KEY}"
    sample = {"prompt": "rename a.txt to b.txt", "response": "Done.", "label": "thanks, it worked"}
    assert asyncio.run(slime_remote_rm(url, sample, reward_key="reward")) == 1.0
    # Without --reward-key slime would take the whole body as the reward: why the docs insist on it.
    whole = asyncio.run(slime_remote_rm(url, sample, reward_key=None))
    assert isinstance(whole, dict) and whole["status"] == "ok"
    with pytest.raises(ClientGaveUp):  # a missing label is a 400, which slime retries, then raises
        asyncio.run(slime_remote_rm(url, {"prompt": "x", "response": "y", "label": None}, reward_key="reward"))


@pytest.mark.e2e
def test_judge_failure_runs_the_client_retry_path_or_the_fallback(
    failing_judges: tuple[ManagedProcess, ManagedProcess],
) -> None:
    plain, fallback = failing_judges
    body = {"query": QUERIES[:1], "prompts": PROMPTS[:1], "labels": LABELS[:1]}
    r = httpx.post(f"{plain.url}/get_reward?api_key={KEY}", json=body, trust_env=False, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["type"] == "RewardUnavailable"
    with pytest.raises(ClientGaveUp):
        openrlhf_2025(f"{plain.url}/get_reward?api_key={KEY}", QUERIES, PROMPTS, LABELS)
    sample = {"prompt": "x", "response": "y", "label": "thanks"}
    with pytest.raises(ClientGaveUp):
        asyncio.run(slime_remote_rm(f"{plain.url}/slime/reward?api_key={KEY}", sample, reward_key="reward"))

    out = openrlhf_2025(f"{fallback.url}/get_reward?api_key={KEY}", QUERIES, PROMPTS, LABELS)
    assert out["attempts"] == 1 and out["rewards"].tolist() == [0.0, 0.0]
    assert out["extra_logs"]["judge_failed"].tolist() == [1.0, 1.0]
    assert out["extra_logs"]["judge_ok"].tolist() == [0.0, 0.0]
    assert asyncio.run(slime_remote_rm(f"{fallback.url}/slime/reward?api_key={KEY}", sample, "reward")) == 0.0


@pytest.mark.e2e
def test_query_key_is_in_no_log_line_and_no_metric(
    rules_judge: ManagedProcess, failing_judges: tuple[ManagedProcess, ManagedProcess]
) -> None:
    # Requests that succeed, fail auth with a near-miss key, fail validation and fail the judge.
    base = {"query": QUERIES[:1], "prompts": PROMPTS[:1], "labels": LABELS[:1]}
    for url, body in [
        (f"{rules_judge.url}/get_reward?api_key={KEY}", base),
        (f"{rules_judge.url}/get_reward?x=1&api_key={KEY}x", base),
        (f"{rules_judge.url}/get_reward?api_key={KEY}", {"query": "not a list"}),
        (f"{rules_judge.url}/slime/reward?api_key={KEY}", {"prompt": "p", "response": "r", "label": "ok"}),
        (f"{failing_judges[0].url}/get_reward?api_key={KEY}", base),
    ]:
        httpx.post(url, json=body, trust_env=False, timeout=60)
    metrics = httpx.get(rules_judge.url + "/metrics", trust_env=False).text
    assert 'route="/get_reward"' in metrics and KEY not in metrics and "api_key" not in metrics
    assert "/slime/reward" in rules_judge.log_path.read_text()  # logged before the response's last byte
    for judge in (rules_judge, *failing_judges):
        text = judge.log_path.read_text()
        assert text.strip() and KEY not in text, judge.name
    assert "/get_reward" in rules_judge.log_path.read_text()


@pytest.mark.e2e
def test_reward_clients_example_runs_as_written(rules_judge: ManagedProcess) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "reward_clients.py"
    run = [sys.executable, str(example), "--judge-url", rules_judge.url]
    res = subprocess.run([*run, "--api-key", KEY], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # The rules backend: "thanks, it worked" is a success (+1), "that is wrong, ..." a failure (-1).
    assert "OpenRLHF /get_reward rewards: [1.0, -1.0]" in res.stdout, res.stdout
    assert "slime /slime/reward label='thanks, it worked': reward=1.0 status=ok" in res.stdout, res.stdout
    assert "slime /slime/reward label='that is wrong, I wanted c.txt': reward=-1.0 status=ok" in res.stdout
    assert KEY not in res.stdout + res.stderr
    unkeyed = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert unkeyed.returncode != 0 and "401" in unkeyed.stderr and "rewards:" not in unkeyed.stdout
