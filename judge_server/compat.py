"""Other trainers' remote-reward requests mapped onto judge requests, and judge results shaped into
the answers their clients accept (pure functions; the routes are in routes.py).

OpenRLHF ``POST /get_reward`` (``{"query": [...], "prompts"?: [...], "labels"?: [...]}``):
- A query string that is a JSON object with ``response`` and ``next_state`` is taken as a full
  /v1/judge request (context included): the lossless form for Hindsight-aware callers.
- Otherwise ``prompts[i]`` must be given and be a prefix of ``query[i]``: context = one user message
  ``prompts[i]``, response = the rest of the query string, next state = ``labels[i]`` (a string is a user
  message; a message dict or a list of them is used as is). Without a label there is no evidence: 400.
- Only the ``prm`` task runs. The answer holds numbers only, because OpenRLHF turns ``rewards``,
  ``scores`` and (since its 2025 versions) every ``extra_logs`` value into a tensor:
  ``{"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}`` with one entry per query;
  ``extra_logs`` = ``judge_ok``/``judge_tie``/``judge_no_valid_votes``/``judge_failed`` (1.0 for the
  item's status, else 0.0) and ``judge_confidence`` (share of valid votes that agree; 0.0 when failed).
- A ``judge_failed`` item has no score. By default the whole request is answered 503 ``RewardUnavailable``
  so the client's retry path runs (OpenRLHF retries any non-2xx a few times, then raises: an explicit
  failure, never a made-up reward). With ``compat_failed_reward`` set (``--compat-failed-reward F``) a
  failed item is answered ``F`` instead, flagged by ``judge_failed: 1.0``: a documented numeric fallback
  for runs that prefer a neutral reward to a stopped rollout.
slime ``--rm-url`` (``{"prompt", "response", "label"}``): prompt is a string (one user message) or a
message list; label is the next state as above. Answer ``{"reward": float, "status", "confidence", "prm",
"prompt_versions"}``: slime must be run with ``--reward-key reward`` (without it slime takes the whole dict
as the reward). A ``judge_failed`` item is answered 503 (slime retries with backoff, then raises), or
``compat_failed_reward`` as above with ``status: "judge_failed"``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from engine.records import STATUS_FAILED, STATUS_NO_VALID, STATUS_OK, STATUS_TIE
from engine.validation import describe_validation_errors
from judge_server.errors import InvalidRequest, RewardUnavailable
from judge_server.schemas import JudgeRequest

# extra_logs name per PRM status: one-hot floats, so a trainer's tensor conversion and mean() both work.
STATUS_LOG_NAMES = {
    STATUS_OK: "judge_ok",
    STATUS_TIE: "judge_tie",
    STATUS_NO_VALID: "judge_no_valid_votes",
    STATUS_FAILED: "judge_failed",
}


def label_to_next_state(label: Any) -> list[dict[str, Any]]:
    if isinstance(label, str) and label.strip():
        return [{"role": "user", "content": label}]
    if isinstance(label, dict):
        return [label]
    if isinstance(label, list) and label:
        return [m if isinstance(m, dict) else {"role": "user", "content": str(m)} for m in label]
    raise InvalidRequest("label (the next state: a user reply or tool output) is required and must be non-empty")


def _build(body: dict[str, Any], where: str) -> JudgeRequest:
    try:
        return JudgeRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(
            f"{where}: {describe_validation_errors(exc.errors(), limit=None)}", status_code=422
        ) from exc


def openrlhf_items(query: list[str], prompts: list[str] | None, labels: list[Any] | None) -> list[JudgeRequest]:
    if prompts is not None and len(prompts) != len(query):
        raise InvalidRequest(f"prompts has {len(prompts)} entries but query has {len(query)}")
    if labels is not None and len(labels) != len(query):
        raise InvalidRequest(f"labels has {len(labels)} entries but query has {len(query)}")
    items = []
    for i, q in enumerate(query):
        obj = None
        if q.lstrip().startswith("{"):
            try:
                obj = json.loads(q)
            except ValueError:
                obj = None
        if isinstance(obj, dict) and "response" in obj and "next_state" in obj:
            items.append(_build({**obj, "tasks": ["prm"]}, f"query[{i}]"))
            continue
        if prompts is None:
            raise InvalidRequest(f"query[{i}] is not a judge request JSON object and no prompts were given")
        if not q.startswith(prompts[i]):
            raise InvalidRequest(f"query[{i}] does not start with prompts[{i}]")
        if labels is None:
            raise InvalidRequest(f"query[{i}]: labels (the next states) are required")
        body = {
            "context": [{"role": "user", "content": prompts[i]}],
            "response": {"content": q[len(prompts[i]) :]},
            "next_state": label_to_next_state(labels[i]),
            "tasks": ["prm"],
        }
        items.append(_build(body, f"query[{i}]"))
    return items


def slime_item(prompt: Any, response: str, label: Any) -> JudgeRequest:
    if isinstance(prompt, str):
        context = [{"role": "user", "content": prompt}] if prompt else []
    else:
        context = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    body = {
        "context": context,
        "response": {"content": response},
        "next_state": label_to_next_state(label),
        "tasks": ["prm"],
    }
    return _build(body, "slime request")


def _reward_of(prm: dict[str, Any], failed_reward: float | None) -> float:
    if prm["status"] != STATUS_FAILED:
        return float(prm["score"])
    if failed_reward is None:
        raise RewardUnavailable(f"judge failed: {prm.get('reason') or 'no verdict'}; retry the request")
    return float(failed_reward)


def openrlhf_reply(results: list[dict[str, Any]], failed_reward: float | None) -> dict[str, Any]:
    """The /get_reward answer for judge results (one per query): numbers only, see the module docstring.

    Raises RewardUnavailable (503) when an item failed and no ``failed_reward`` fallback is configured.
    """
    prms = [r["prm"] for r in results]
    rewards = [_reward_of(prm, failed_reward) for prm in prms]
    extra_logs = {
        name: [1.0 if prm["status"] == status else 0.0 for prm in prms] for status, name in STATUS_LOG_NAMES.items()
    }
    extra_logs["judge_confidence"] = [
        0.0 if prm["status"] == STATUS_FAILED else float(prm["confidence"]) for prm in prms
    ]
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": extra_logs}


def slime_reply(result: dict[str, Any], failed_reward: float | None) -> dict[str, Any]:
    """The /slime/reward answer (read by slime with ``--reward-key reward``); RewardUnavailable as above."""
    prm = result["prm"]
    return {
        "reward": _reward_of(prm, failed_reward),
        "status": prm["status"],
        "confidence": 0.0 if prm["status"] == STATUS_FAILED else float(prm["confidence"]),
        "prm": prm,
        "prompt_versions": result["prompt_versions"],
    }
